"""TEST DOUBLE of ``deepinfer._C.engine``: request outputs behind raw pointers, sequences, and the scheduler.

``RequestOutputPool.allocate`` hands out uint64 "pointers" that die when the pool releases them (at the next
``step()`` / flush). Reading a dead pointer raises here; in DeepInfer it reads freed memory.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POOL_CAPACITY = 10_000


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6
    FINISHED_PREEMPTED = 7
    FINISHED_SO_FAILED = 8
    FINISHED_VE_FAILED = 9


_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "prompt_length_exceeded",
    SequenceStatus.FINISHED_PREEMPTED: "insufficient_system_resource",
    SequenceStatus.FINISHED_SO_FAILED: "xgrammar runtime errors or timeout",
    SequenceStatus.FINISHED_VE_FAILED: "ve_error",
}


def get_finished_reason(status: SequenceStatus) -> str:
    return _FINISH_REASONS.get(status, "")


@dataclass(slots=True)
class _Output:
    request_id: str
    prompt_len: int
    token_id: int
    finish_reason: str
    finished: bool
    token_logprobs: float
    top_logprobs: list[float]
    top_token_ids: list[int]
    num_output_tokens: int
    draft_tok: int = 0
    accept_tok: int = 0
    nextn_logprobs: float = 1.0
    sum_smaller_probs: float = -1.0
    confidence_score: list[float] | None = None
    prompt_logprobs: list[float] = field(default_factory=list)
    max_num_batched_tokens: int = 0


_LIVE: dict[int, _Output] = {}
_ADDRESSES = itertools.count(0x7F3A_0000_1000, 0x40)


def _deref(ptr: int) -> _Output:
    record = _LIVE.get(int(ptr))
    if record is None:
        raise RuntimeError(
            f"RequestOutput pointer {int(ptr):#x} is stale: it was freed by a later step() or flush "
            "(test double; DeepInfer would silently read freed memory). Read outputs before stepping again."
        )
    return record


class RequestOutput:
    """A Python-owned copy (from ``clone``) with attributes, plus static getters over raw pointers."""

    def __init__(self, record: _Output) -> None:
        for name in _Output.__slots__:
            value = getattr(record, name)
            setattr(self, name, list(value) if isinstance(value, list) else value)

    @staticmethod
    def clone(ptr: int) -> RequestOutput:
        return RequestOutput(_deref(ptr))

    @staticmethod
    def get_request_id(ptr: int) -> str:
        return _deref(ptr).request_id

    @staticmethod
    def get_token_id(ptr: int) -> int:
        return _deref(ptr).token_id

    @staticmethod
    def get_finished(ptr: int) -> bool:
        return _deref(ptr).finished

    @staticmethod
    def get_finish_reason(ptr: int) -> str:
        return _deref(ptr).finish_reason

    @staticmethod
    def get_num_output_tokens(ptr: int) -> int:
        return _deref(ptr).num_output_tokens

    @staticmethod
    def get_prompt_len(ptr: int) -> int:
        return _deref(ptr).prompt_len

    @staticmethod
    def get_token_logprobs(ptr: int) -> float:
        return _deref(ptr).token_logprobs

    @staticmethod
    def get_top_logprobs(ptr: int) -> list[float]:
        return list(_deref(ptr).top_logprobs)

    @staticmethod
    def get_top_token_ids(ptr: int) -> list[int]:
        return list(_deref(ptr).top_token_ids)

    @staticmethod
    def get_prompt_logprobs(ptr: int) -> list[float]:
        return list(_deref(ptr).prompt_logprobs)

    @staticmethod
    def get_draft_tok(ptr: int) -> int:
        return _deref(ptr).draft_tok

    @staticmethod
    def get_accept_tok(ptr: int) -> int:
        return _deref(ptr).accept_tok

    @staticmethod
    def get_confidence_score(ptr: int) -> list[float] | None:
        return _deref(ptr).confidence_score

    @staticmethod
    def get_nextn_logprobs(ptr: int) -> float:
        return _deref(ptr).nextn_logprobs

    @staticmethod
    def get_sum_smaller_probs(ptr: int) -> float:
        return _deref(ptr).sum_smaller_probs


class RequestOutputPool:
    """Owns the outputs of one step until ``release``; 10000 live outputs at most, as in DeepInfer."""

    def __init__(self) -> None:
        self._owned: list[int] = []

    def allocate(self, records: SequenceOf[_Output]) -> np.ndarray:
        if len(_LIVE) + len(records) > POOL_CAPACITY:
            raise RuntimeError("RequestOutputPool exhausted")
        pointers = []
        for record in records:
            address = next(_ADDRESSES)
            _LIVE[address] = record
            pointers.append(address)
        self._owned.extend(pointers)
        return np.array(pointers, dtype=np.uint64)

    def release(self, unused_request_outputs: Iterable[int] | None = None) -> None:
        owned = self._owned if unused_request_outputs is None else [int(p) for p in unused_request_outputs]
        for address in owned:
            _LIVE.pop(address, None)
        if unused_request_outputs is None:
            self._owned = []


class Sequence:
    """A request inside the engine; ``add_request`` returns it. Its prompt must be a C-contiguous int32 array."""

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: np.ndarray,
        compressed_prompt_token_ids: np.ndarray,
        multi_modal_data: Any,
        block_size: int,
        request_id: str,
        user_id: str,
        sampling_params: Any,
        arrival_time: float,
        golden_token_ids: SequenceOf[int] | None,
    ) -> None:
        array = prompt_token_ids
        if not (
            isinstance(array, np.ndarray) and array.dtype == np.int32 and array.ndim == 1 and array.flags.c_contiguous
        ):
            raise TypeError(
                "__init__(): incompatible constructor arguments (prompt_token_ids must be a 1-D C-contiguous "
                "numpy.ndarray[numpy.int32]; py::arg().noconvert())"
            )
        self.seq_id = seq_id
        self.prompt_token_ids = array.copy()
        self.request_id = request_id
        self.user_id = user_id
        self.sampling_params = sampling_params
        self.multi_modal_data = multi_modal_data
        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.blocks = 0
        self.num_cached_tokens = 0  # tokens with computed KV (DeepInfer's ``cache.num_tokens``): none before prefill
        self.schedulable = multi_modal_data is None
        self.holds_slot = False  # finished after running: still in DeepInfer's ``running`` until a decode schedule
        self.echo: list[int] = []  # the double's "model": which tokens this request repeats

    def get_prompt_len(self) -> int:
        return int(self.prompt_token_ids.size)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_len(self) -> int:
        return self.get_prompt_len() + self.get_output_len()

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else int(self.prompt_token_ids[-1])


class Scheduler:
    """Waiting and running queues, KV blocks, and the counters DeepInfer's stats read."""

    def __init__(self, block_size: int, num_gpu_blocks: int) -> None:
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.free_blocks = num_gpu_blocks - 1  # one block is reserved, as DeepInfer's stats assume
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ignored: list[Sequence] = []  # finished without running: their synthetic output is due
        self.retiring: list[Sequence] = []
        """Finished, but still counted as unfinished until the next schedule after their final output was
        returned (DeepInfer removes finished sequences when it schedules): a loop that steps while
        ``has_unfinished_requests()`` runs one step more, which returns nothing for them."""
        self.num_preempted = 0
        self.num_aborted = 0
        self.decode_step = 0

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def add_sequence(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort_sequence(self, request_ids: SequenceOf[str]) -> list[Sequence]:
        wanted = set(request_ids)
        aborted: list[Sequence] = []
        for seq in list(self.running):
            if seq.request_id in wanted:
                self.running.remove(seq)
                self.free(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED  # running: no output, ever
                aborted.append(seq)
        for seq in list(self.waiting):
            if seq.request_id in wanted:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
                self.ignored.append(seq)  # waiting: one synthetic "abort" output later
                aborted.append(seq)
        self.num_aborted += len(aborted)
        return aborted

    def free(self, seq: Sequence) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def occupied_slots(self) -> int:
        """Running requests, and finished ones still in DeepInfer's ``running`` list: what ``max_num_seqs`` caps."""
        return len(self.running) + sum(seq.holds_slot for seq in self.retiring)

    def get_num_free_gpu_blocks(self) -> int:
        return self.free_blocks

    def get_sum_prompt_len_running(self) -> tuple[int, int]:
        return len(self.running), sum(s.get_prompt_len() for s in self.running)

    def get_sum_prompt_len_waiting(self) -> tuple[int, int]:
        return len(self.waiting), sum(s.get_prompt_len() for s in self.waiting)

    def get_sum_prompt_len_chunked(self) -> tuple[int, int]:
        return 0, 0

    def get_num_preempted_seqs(self) -> int:
        return self.num_preempted

    def get_num_aborted_seqs(self) -> int:
        return self.num_aborted

    def get_num_unfinished_seqs(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.ignored) + len(self.retiring)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.ignored or self.retiring)
