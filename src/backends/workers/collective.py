"""Collectives across data-parallel ranks, and a CPU imitation of DeepInfer's for the reference engine.

With DP > 1, DeepInfer's ``has_unfinished_requests()`` is a MAX all-reduce over the DP group and ``step()`` and
``close()`` contain collectives: every rank must make the same calls in the same order, or the group hangs. The
worker loop (``backends.workers.rank_loop``) is written to that rule; ``LockstepEngine`` makes the reference engine
obey it too, so the rule is tested on CPU. ``SimulatedGroup`` is the imitation of the interconnect: a MAX
all-reduce through a hub on rank 0 (as torch.distributed rendezvous at rank 0's store), which also checks that
every rank is in the *same* collective, so a protocol slip fails loudly instead of passing by luck.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import msgpack
import zmq

from backends.engine.protocol import Engine, EngineOutput

COLLECTIVE_TIMEOUT_SECONDS = 120.0
"""A collective that waits this long means a peer is gone; real groups (gloo, NCCL) have such timeouts too."""


class CollectiveError(RuntimeError):
    """Ranks disagreed on which collective they were in, or a peer never arrived."""


class DataParallelGroup(Protocol):
    """The one collective the worker loop itself needs: ranks agree when to stop (a MAX all-reduce)."""

    def all_reduce_max(self, value: int, op: str) -> int: ...

    def close(self) -> None: ...


class SimulatedGroup:
    """A MAX all-reduce over ZeroMQ: every rank sends ``(round, op, value)`` to a hub on rank 0 and blocks.

    The hub answers when all ``size`` ranks arrived, after checking they are in the same round of the same
    collective (``op``); otherwise every rank gets an error. It answers rank 0 last, so rank 0 cannot exit
    (after the final ``close`` collective) before the others have their answer.
    """

    def __init__(self, rank: int, size: int, endpoint: str, *, timeout: float = COLLECTIVE_TIMEOUT_SECONDS) -> None:
        self.rank = rank
        self.size = size
        self._round = 0
        self._timeout_ms = int(timeout * 1000)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._hub: threading.Thread | None = None
        if rank == 0:
            router = self._context.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 2000)
            router.bind(endpoint)
            self._hub = threading.Thread(target=_run_hub, args=(router, size), name="collective-hub", daemon=True)
            self._hub.start()
        self._socket = self._context.socket(zmq.REQ)
        self._socket.setsockopt(zmq.IDENTITY, f"rank-{rank}".encode())
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)

    def all_reduce_max(self, value: int, op: str) -> int:
        self._round += 1
        self._socket.send(msgpack.packb([self._round, op, value]))
        if not self._socket.poll(self._timeout_ms):
            raise CollectiveError(f"rank {self.rank}: peers did not join {op!r} within {self._timeout_ms} ms")
        ok, result = msgpack.unpackb(self._socket.recv())
        if not ok:
            raise CollectiveError(result)
        return int(result)

    def close(self) -> None:
        self._socket.close()
        if self._hub is not None:
            self._hub.join(timeout=5)


def _run_hub(router: zmq.Socket, size: int) -> None:
    """Rank 0's hub thread: gathers one contribution per rank per round, answers each with the maximum."""
    arrived: dict[bytes, tuple[int, str, int]] = {}
    try:
        while True:
            identity, _, payload = router.recv_multipart()
            round_, op, value = msgpack.unpackb(payload)
            arrived[identity] = (round_, op, value)
            if len(arrived) < size:
                continue
            calls = {(r, o) for r, o, _ in arrived.values()}
            if len(calls) == 1:
                answer = msgpack.packb([True, max(v for _, _, v in arrived.values())])
            else:
                seen = ", ".join(f"{i.decode()}: {o} #{r}" for i, (r, o, _) in sorted(arrived.items()))
                answer = msgpack.packb([False, f"ranks are in different collectives ({seen})"])
            last = b"rank-0"
            for identity in sorted(arrived, key=lambda i: i == last):
                router.send_multipart([identity, b"", answer])
            closing = next(iter(calls))[1] == "close"
            arrived.clear()
            if closing:
                return
    except zmq.ZMQError:
        return  # the process is exiting
    finally:
        router.close()


class LockstepEngine:
    """The reference engine made to behave like one DeepInfer DP rank: its collectives block on every rank.

    ``has_unfinished_requests`` is the group's MAX all-reduce; ``step`` ends in a group barrier, as DeepInfer's
    forward ends in the expert-parallel all-to-all, so an idle rank's step is a placeholder that lasts as long as
    the busiest rank's; ``close`` is a barrier too. Everything else is local, as in DeepInfer.
    """

    def __init__(self, engine: Engine, group: SimulatedGroup) -> None:
        self.engine = engine
        self.group = group
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_num_seqs = getattr(engine, "max_num_seqs", 0)

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: Any,
        multi_modal_data: dict[str, Any] | None = None,
    ) -> object | None:
        return self.engine.add_request(user_id, request_id, sampling_params, prompt_token_ids, multi_modal_data)

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        return self.engine.abort_request(request_id)

    def get_num_unfinished_requests(self) -> int:
        return self.engine.get_num_unfinished_requests()

    def has_unfinished_requests(self) -> bool:
        return bool(self.group.all_reduce_max(int(self.engine.has_unfinished_requests()), "has_unfinished_requests"))

    def step(self) -> Sequence[EngineOutput]:
        outputs = self.engine.step()
        self.group.all_reduce_max(0, "step")
        return outputs

    def flush_inflight_reqs(self) -> Sequence[EngineOutput]:
        return self.engine.flush_inflight_reqs()

    def close(self) -> None:
        self.group.all_reduce_max(0, "close")
        self.engine.close()
        self.group.close()
