"""What routing adds to a request: the per-request cost of each policy, measured in process.

Builds a ``ModelRouter`` over in-memory backends that answer at once (so only the router is measured) and
times, for each policy and target count:

- ``decide``: choosing the target (``ModelRoutes.choose``: availability check, policy pick);
- ``route``: the whole per-request routing work: ``ModelRouter.route`` (decision, in-flight count, routed
  counter), opening the stream, the first event, and the end-of-stream accounting (breaker, latency window),
  minus the same request iterated on the backend directly;
- ``per_event``: what the routed stream adds to each later event (one extra await, no per-token work).

Each figure is the best of several rounds of many requests (best-of filters scheduler noise on a shared
machine). Usage: ``python bench/routing_cost.py [--requests 20000] [--rounds 5]``. Writes
``bench/results/routing_cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers

from backends.interface import Delta, Event, Finish, GenerateRequest, Usage
from gateway.config import ModelConfig
from gateway.routing.model_router import ModelRouter

EVENTS = 64  # events per request in the per-event measurement
RESULTS = Path(__file__).resolve().parent / "results" / "routing_cost.json"


class InstantBackend:
    """A backend that is always ready and yields its events without waiting: only routing is measured."""

    kind = "bench"

    def __init__(self, name: str, events: int) -> None:
        self.name = name
        self._events = [Delta(0, "x")] * (events - 2) + [Finish(0, "length"), Usage(10, events - 2)]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def readiness(self) -> tuple[bool, str]:
        return True, "ready"

    def max_model_len(self) -> int | None:
        return None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        for event in self._events:
            yield event


def chat_request(prompt_chars: int) -> GenerateRequest:
    system = ("You are a helpful assistant. " * (prompt_chars // 29 + 1))[:prompt_chars]
    return GenerateRequest(
        request_id="bench",
        model="m",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "What is a file?"}],
    )


def build_router(policy: str, targets: int, events: int, **extra: Any) -> ModelRouter:
    backends = {f"b{i}": InstantBackend(f"b{i}", events) for i in range(targets)}
    model = ModelConfig(name="m", backends=list(backends), policy=policy, **extra)  # type: ignore[arg-type]
    return ModelRouter([model], backends)  # type: ignore[arg-type]


def best_of(rounds: int, once: Callable[[], float]) -> float:
    return min(once() for _ in range(rounds))


async def measure(
    policy: str,
    targets: int,
    *,
    requests: int,
    rounds: int,
    prompt_chars: int = 256,
    headers: Headers | None = None,
    **extra: Any,
) -> dict[str, Any]:
    router = build_router(policy, targets, 2, **extra)
    routes = router.model_routes("m")  # the decision alone, without the stream around it
    request = chat_request(prompt_chars)

    def decide() -> float:
        start = time.perf_counter()
        for _ in range(requests):
            routes.choose(request, headers)
        return (time.perf_counter() - start) / requests

    async def requests_through(routed: bool, n: int, router: ModelRouter) -> float:
        backend = next(iter(router.backends_of("m")))

        def factory(target: Any) -> AsyncIterator[Event]:
            return target.generate(request)

        start = time.perf_counter()
        for _ in range(n):
            events = router.route("m", request, headers, factory) if routed else factory(backend)
            async for _event in events:
                pass
            await events.aclose()  # type: ignore[attr-defined]
        return (time.perf_counter() - start) / n

    decision = best_of(rounds, decide)
    routed = raw = float("inf")
    for _ in range(rounds):
        raw = min(raw, await requests_through(False, requests, router))
        routed = min(routed, await requests_through(True, requests, router))
    long_router = build_router(policy, targets, EVENTS, **extra)
    long_routed = long_raw = float("inf")
    for _ in range(rounds):
        long_raw = min(long_raw, await requests_through(False, requests // 8, long_router))
        long_routed = min(long_routed, await requests_through(True, requests // 8, long_router))
    per_event = ((long_routed - long_raw) - (routed - raw)) / (EVENTS - 2)
    return {
        "policy": policy,
        "targets": targets,
        "prompt_chars": prompt_chars,
        "session_header": headers is not None and "x-session-id" in headers,
        "pinned": headers is not None and "x-backend" in headers,
        "decide_us": round(decision * 1e6, 2),
        "route_us": round((routed - raw) * 1e6, 2),
        "per_event_us": round(max(0.0, per_event) * 1e6, 3),
        "request_on_backend_alone_us": round(raw * 1e6, 2),
    }


async def run(requests: int, rounds: int) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for targets in (1, 3, 8):
        for policy in ("weighted", "least_outstanding", "prefix_affinity"):
            cases.append(await measure(policy, targets, requests=requests, rounds=rounds))
    for prompt_chars in (4096, 65536):
        cases.append(await measure("prefix_affinity", 3, requests=requests, rounds=rounds, prompt_chars=prompt_chars))
    session = Headers({"x-session-id": "conversation-42"})
    cases.append(await measure("prefix_affinity", 3, requests=requests, rounds=rounds, headers=session))
    pinned = Headers({"x-backend": "b1"})
    cases.append(await measure("weighted", 3, requests=requests, rounds=rounds, headers=pinned, allow_pin_header=True))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cases = asyncio.run(run(args.requests, args.rounds))
    header = (
        f"{'policy':<18} {'targets':>7} {'prompt':>7} {'variant':<8} {'decide µs':>10} {'route µs':>9} "
        f"{'per event µs':>13}"
    )
    print(header)
    print("-" * len(header))
    for c in cases:
        variant = "session" if c["session_header"] else "pinned" if c["pinned"] else ""
        print(
            f"{c['policy']:<18} {c['targets']:>7} {c['prompt_chars']:>7} {variant:<8} {c['decide_us']:>10.2f} "
            f"{c['route_us']:>9.2f} {c['per_event_us']:>13.3f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "python": platform.python_version(),
                "machine": platform.machine(),
                "requests_per_round": args.requests,
                "rounds": args.rounds,
                "cases": cases,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwritten to {RESULTS}")


if __name__ == "__main__":
    main()
