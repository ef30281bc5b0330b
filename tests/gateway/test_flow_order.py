"""The order ``FlowController`` admits waiters in, driven directly: one slot, releases one at a time.

The flood tests (``test_flow_control.py``) show the order through a real gateway; these pin the cases a gateway
with keys cannot show: fair sharing by ``user`` without keys, vLLM's ``priority`` within a tier, and the tier's
state forgotten once its queue empties.
"""

from __future__ import annotations

import asyncio

from backends.interface import SERVICE_TIERS, GenerateRequest, SamplingOptions
from gateway.flow_control import FlowController, TierBounds


def _request(user: str | None = None, *, tier: str = "default", priority: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        model="m",
        prompt="hi",
        sampling=SamplingOptions(max_tokens=16),
        user=user,
        service_tier=tier,
        priority=priority,
    )


async def _admission_order(gate: FlowController, waiters: list[tuple[str, GenerateRequest]]) -> list[str]:
    """Holds the one slot, queues ``waiters`` in order, then frees the slot once per admission."""
    holder = _request()
    await gate.acquire(holder, gate.admission_of(holder))
    admitted: asyncio.Queue[str] = asyncio.Queue()

    async def wait(name: str, request: GenerateRequest) -> None:
        await gate.acquire(request, gate.admission_of(request))
        admitted.put_nowait(name)

    tasks = []
    for name, request in waiters:
        tasks.append(asyncio.create_task(wait(name, request)))
        await asyncio.sleep(0)  # it runs up to its wait in the queue: arrival order is the list's
        assert gate.queued == len(tasks)
    order = []
    for _ in waiters:
        gate.release(1.0)
        order.append(await admitted.get())
    gate.release(1.0)
    await asyncio.gather(*tasks)
    return order


def _gate(*, fair: bool = True) -> FlowController:
    """One slot; every tier may queue 8 for a minute."""
    return FlowController("b", 1, {tier: TierBounds(8, 60.0) for tier in SERVICE_TIERS}, fair=fair)


def test_without_keys_users_share_fairly_and_requests_without_a_user_are_one_flow() -> None:
    gate = _gate()
    waiters = [(f"a{i}", _request("alice")) for i in range(3)] + [("b0", _request("bob")), ("n0", _request())]
    assert asyncio.run(_admission_order(gate, waiters)) == ["a0", "b0", "n0", "a1", "a2"]


def test_priority_orders_within_a_tier_and_tiers_come_first() -> None:
    gate = _gate()
    waiters = [
        ("flex", _request(tier="flex", priority=-5)),
        ("late", _request(priority=3)),
        ("early", _request(priority=-1)),
        ("best", _request(tier="priority", priority=9)),
    ]
    assert asyncio.run(_admission_order(gate, waiters)) == ["best", "early", "late", "flex"]


def test_fifo_ignores_tiers_priorities_and_users() -> None:
    gate = _gate(fair=False)
    waiters = [
        ("a0", _request("alice", tier="flex")),
        ("a1", _request("alice")),
        ("b0", _request("bob", tier="priority", priority=-9)),
    ]
    assert asyncio.run(_admission_order(gate, waiters)) == ["a0", "a1", "b0"]
