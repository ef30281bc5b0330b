"""TEST DOUBLE of ``deepinfer.engine.llm_engine``: DeepInfer's ``LLMEngine`` contract over an echo "model".

What a binding must get right is imitated faithfully (see README.md here and the fact sheet): one thread, pointer
outputs freed at the next step, zero-overhead-scheduling lag with a flush, abort semantics, grammar compiles
invisible to ``abort_request``, silent drops of out-of-range token ids, synthetic final outputs, KV-cache
preemption. The tokens themselves are trivial: a request repeats its prompt's plain-text tokens, then emits EOS.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch  # as in DeepInfer: torch is loaded before deepinfer._C
from deep_cluster.hardware import get_bf16_tflops_limit

from deepinfer import _double, envs
from deepinfer._C.engine import (
    RequestOutputPool,
    Scheduler,
    Sequence,
    SequenceStatus,
    _Output,
    get_finished_reason,
)
from deepinfer.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.engine_type import EngineType
from deepinfer.hugging_face import get_hf_tokenizer
from deepinfer.model_executor.parallel_utils.parallel_state import PG
from deepinfer.sampling_params import SamplingParams

NUM_MM_SPECIAL = 5
SO_COMPILE_STEPS = 2
"""``step()`` calls a grammar takes to "compile"; meanwhile the request is invisible to ``abort_request``."""
SYNTHETIC_LOGPROB = 1.0
PREFILL_KV_WATERMARK = 0.9
"""A rank wants a prefill only while at most this share of its KV blocks is in use (DeepInfer's watermark)."""


class LLMEngine:
    """An in-process engine driven by ``add_request`` / ``step`` from the thread that built it."""

    constructions = 0
    """How many constructions began in this process (double only): each would load the weights."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        parallel_config: ParallelConfig,
        scheduler_config: SchedulerConfig,
        log_stats: bool,
        engine_type: EngineType = EngineType.NORMAL,
        offline_inference: bool = False,
    ) -> None:
        LLMEngine.constructions += 1
        gpu_ids = list(map(int, os.environ["CUDA_VISIBLE_DEVICES"].split(",")))  # KeyError when unset
        self.driver_gpu_id = gpu_ids[0]
        self._owner = threading.get_ident()
        self.constructed_on_thread = threading.current_thread().name
        self.model_config = model_config
        self.cache_config = cache_config
        self.parallel_config = parallel_config
        self.scheduler_config = scheduler_config
        self.log_stats = log_stats
        self.engine_type = engine_type
        self.offline_inference = offline_inference
        self.closed = False

        self.data_parallel_size = parallel_config.data_parallel_size
        self.collectives = 0
        """Collective calls this rank made (DP > 1; double only)."""
        if self.data_parallel_size > 1:
            self._init_distributed(parallel_config)
        self.tokenizer = get_hf_tokenizer(model_config.tokenizer, trust_remote_code=model_config.trust_remote_code)
        self.eos_id = self.tokenizer.eos_token_id
        self.multimodal_pool_bytes = (
            8 << 30 if envs.DEEPINFER_USE_MULTIMODAL_POOL and engine_type != EngineType.COMPLETION else 0
        )
        self.zero_overhead_scheduling = envs.DEEPINFER_ZERO_OVERHEAD_SCHEDULING
        self.nextn = envs.DEEPINFER_USE_NEXTN_DECODE
        self.batch_invariant = envs.DEEPINFER_BATCH_INVARIANT

        # _init_cache: memory profiling decides the number of KV blocks.
        num_blocks = int(cache_config.gpu_memory_utilization * _double.kv_blocks_at_full_memory()) // 2 * 2
        cache_config.num_gpu_blocks = num_blocks
        max_seq_len = int(0.8 * cache_config.block_size * num_blocks)
        if model_config.runtime_max_model_len > max_seq_len:
            raise RuntimeError(
                f"The model's runtime max seq len ({model_config.runtime_max_model_len}, derived from "
                f"max_model_len={model_config.max_model_len}) is larger than the maximum number of tokens that can "
                f"be stored in KV cache ({max_seq_len}). Try increasing `gpu_memory_utilization` or decreasing "
                "`max_model_len` when initializing the engine."
            )
        self.scheduler = Scheduler(cache_config.block_size, num_blocks)
        self.request_output_pool = RequestOutputPool()
        self.num_finished_completion = 0
        self.finished_payload: list[tuple[float, tuple[int, int, int, int], int]] = []
        self.generate_step = 0
        self.multimodal_round_trips = 0
        self._seq_ids = itertools.count()
        self._so_pending: dict[str, list[Any]] = {}  # request id -> [sequence, compile steps left]
        self._so_builder_ready = False
        self._deferred: list[_Output] = []  # the decode step still "in flight" under zero-overhead scheduling
        backend = self.tokenizer.backend_tokenizer
        self._vocab_size = model_config.get_vocab_size()
        self._special_ids = frozenset(backend.get_added_tokens_decoder())
        self._filler = next(i for i in range(self._vocab_size) if i not in self._special_ids)
        # As in DeepInfer, the hardware check comes last, after the (here imaginary) weights are loaded.
        self.tflops_limit = get_bf16_tflops_limit()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        model_config, cache_config, parallel_config, scheduler_config = engine_args.create_engine_configs()
        return cls(
            model_config,
            cache_config,
            parallel_config,
            scheduler_config,
            log_stats=not engine_args.disable_log_stats,
            engine_type=engine_args.engine_type,
            offline_inference=engine_args.offline_inference,
        )

    # ---- requests ---------------------------------------------------------------------------------------------

    def add_request(
        self,
        /,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | SamplingParams | None,
        prompt_token_ids: np.ndarray,
        multi_modal_data: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        extra: dict[str, Any] | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
    ) -> Sequence | None:
        self._check_caller()
        if sampling_params is None:
            sampling_params = {}
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(**{k: v for k, v in sampling_params.items() if v is not None})
        sampling_params.eos_id = self.eos_id
        if multi_modal_data is not None:
            self.multimodal_round_trips += 1
        if prompt_token_ids.size == 0:
            raise ValueError("prompt must not be empty")
        limit = self._vocab_size + (NUM_MM_SPECIAL if multi_modal_data is not None else 0)
        if prompt_token_ids.min() < 0 or prompt_token_ids.max() >= limit:
            return None  # DeepInfer drops the request with an INFO log line, nothing else
        seq = Sequence(
            seq_id=next(self._seq_ids),
            prompt_token_ids=prompt_token_ids,
            compressed_prompt_token_ids=prompt_token_ids,
            multi_modal_data=multi_modal_data,
            block_size=self.cache_config.block_size,
            request_id=request_id,
            user_id=user_id,
            sampling_params=sampling_params,
            arrival_time=time.perf_counter() if arrival_time is None else arrival_time,
            golden_token_ids=sampling_params.golden_token_ids,
        )
        seq.echo = [int(t) for t in seq.prompt_token_ids if int(t) not in self._special_ids]
        so_args = sampling_params.so_args
        if so_args is not None:
            if "serialized" in so_args or "bound_token_ids" in so_args:
                raise ValueError("so_args: 'serialized' and 'bound_token_ids' are not accepted")
            if "schema" not in so_args:
                raise KeyError("schema")  # synchronously, as in DeepInfer
            self._build_so_builder()
            self._so_pending[request_id] = [seq, SO_COMPILE_STEPS]
        elif enqueue:
            self.scheduler.add_sequence(seq)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        self._check_caller()
        assert isinstance(request_id, str | dict | set | list | tuple), f"invalid request_id type: {type(request_id)}"
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        seqs = self.scheduler.abort_sequence(ids)  # grammar-compiling requests are not in the scheduler yet
        stopped = {s.request_id for s in seqs}
        if self._deferred and stopped:
            self._deferred = [o for o in self._deferred if o.request_id not in stopped]  # in flight: discarded
        return len(seqs), sum(s.get_len() for s in seqs)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_seqs() + len(self._so_pending)

    def has_unfinished_requests(self) -> bool:
        """Local answer, then (DP > 1) a MAX all-reduce over the DP group: a collective every rank must call."""
        self._check_caller()
        unfinished = self.scheduler.has_unfinished_seqs() or bool(self._so_pending)
        group = PG.cpu_data_parallel_group() if self.zero_overhead_scheduling else PG.data_parallel_group()
        if group.size() > 1:
            import torch
            import torch.distributed as dist

            tensor = torch.full((1,), unfinished, dtype=torch.int64, device="cpu")
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
            self.collectives += 1
            unfinished = tensor.item() > 0
        return unfinished

    def close(self) -> None:
        """DeepInfer's ``Worker.stop``: two world barriers, then the process group goes (every rank together)."""
        self._check_caller()
        if self.data_parallel_size > 1:
            import torch.distributed as dist

            dist.barrier()
            dist.barrier()
            dist.destroy_process_group()
            self.collectives += 3
        self.closed = True
        self.request_output_pool.release()

    # ---- stepping ---------------------------------------------------------------------------------------------

    def step(self) -> np.ndarray:
        """One prefill or decode step. Returns pointers; the previous call's pointers die here."""
        self._check_caller()
        _double.STEP_GATE.wait()
        self.request_output_pool.release()
        scheduler = self.scheduler
        in_flight = {o.request_id for o in self._deferred}
        if scheduler.retiring:  # the schedule drops sequences whose final output was already returned ...
            scheduler.retiring = [s for s in scheduler.retiring if s.request_id in in_flight or s.holds_slot]
        records, self._deferred = self._deferred, []
        records += self._synthetic_outputs()
        prefill = self._schedule_by_vote()
        for seq in scheduler.waiting:  # a multimodal round trip's result is fetched in this step
            seq.schedulable = True
        if prefill is not None:  # a prompt step, or an idle rank's empty one in lockstep with its peers
            records += prefill
            scheduler.decode_step = 0
        else:
            # ... but a request that finished running leaves ``running`` (and frees its slot) only in a decode
            # schedule: DeepInfer tries the prefill first, so a waiting request cannot take that slot yet.
            scheduler.retiring = [s for s in scheduler.retiring if s.request_id in in_flight]
            current = self._decode()
            scheduler.decode_step += 1
            if self.zero_overhead_scheduling:
                self._deferred = current  # comes back from the next step() or flush
            else:
                records += current
        self._pump_grammar_compiles()
        self._account(records)
        self.generate_step += 1
        if self.data_parallel_size > 1:  # the forward's MoE all-to-all: an idle rank's placeholder step joins it
            import torch.distributed as dist

            dist.barrier(group=PG.world_group())
            self.collectives += 1
        delay = _double.step_seconds()
        if delay:
            time.sleep(delay)
        return self.request_output_pool.allocate(records)

    def flush_inflight_reqs(self) -> np.ndarray:
        """Drains the step still in flight (zero-overhead scheduling, mid-decode); once the engine has no
        unfinished request there is nothing in flight and it returns an empty array, as DeepInfer's does."""
        self._check_caller()
        self.request_output_pool.release()
        records, self._deferred = self._deferred, []
        records += self._synthetic_outputs()
        self._account(records)
        return self.request_output_pool.allocate(records)

    # ---- internals ----------------------------------------------------------------------------------------------

    def _init_distributed(self, parallel_config: ParallelConfig) -> None:
        """DeepInfer's rendezvous: gloo at ``tcp://MASTER_ADDR:(MASTER_PORT - 50 + engine_group_rank)``.

        The double's world is the DP ranks' driver processes (it spawns no CP workers), so its rank is the DP rank.
        """
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "localhost")
        port = int(os.environ.get("MASTER_PORT", "23333")) - 50 + parallel_config.engine_group_rank
        dist.init_process_group(
            backend="gloo",
            world_size=self.data_parallel_size,
            rank=parallel_config.data_parallel_rank,
            init_method=f"tcp://{host}:{port}",
        )
        PG.create_process_groups(self.data_parallel_size)

    def _check_caller(self) -> None:
        if self.closed:
            raise RuntimeError("engine is closed")
        if threading.get_ident() != self._owner:
            raise RuntimeError(
                f"LLMEngine called from thread {threading.current_thread().name!r}, but it was built on "
                f"{self.constructed_on_thread!r}: DeepInfer's engine must be driven from one thread"
            )

    def _build_so_builder(self) -> None:
        if self._so_builder_ready:
            return
        wanted = envs.DEEPINFER_SO_BUILDER_CPUS
        if wanted > _double.idle_cpus():
            raise RuntimeError(f"not enough idle CPUs in this GPU's slice for {wanted} grammar compiler threads")
        self._so_builder_ready = True

    def _pump_grammar_compiles(self) -> None:
        for request_id, entry in list(self._so_pending.items()):
            entry[1] -= 1
            if entry[1] > 0:
                continue
            del self._so_pending[request_id]
            seq: Sequence = entry[0]
            if seq.sampling_params.so_args.get("schema_type") not in ("json", "regex", "ebnf"):
                seq.status = SequenceStatus.FINISHED_SO_FAILED
                self.scheduler.ignored.append(seq)
            else:
                self.scheduler.add_sequence(seq)

    def _schedule_by_vote(self) -> list[_Output] | None:
        """DeepInfer's NORMAL step type: a prompt step (its outputs; ``[]`` for an empty one) or ``None`` (decode).

        A prefill is tried only at an ALL point (``decode_step % prefill_attempt_interval == 0``: every DP rank must
        want one) or an ANY point (``decode_step != 0`` and a multiple of ``prefill_any_attempt_interval``: one
        rank suffices; a step that is both counts as ANY). A rank wants one when its KV usage is at most the
        watermark and the head of its waiting queue is schedulable. A second vote checks that some rank did
        schedule something (slots or blocks may have run out); if one did, the others run an empty prompt step.
        Both votes are DP all-reduces, so every rank takes the same step type and ``decode_step`` stays equal.
        """
        scheduler, config = self.scheduler, self.scheduler_config
        step = scheduler.decode_step
        any_point = step != 0 and step % config.prefill_any_attempt_interval == 0
        all_point = step % config.prefill_attempt_interval == 0
        if not (any_point or all_point):
            return None
        want = self._kv_usage() <= PREFILL_KV_WATERMARK and bool(scheduler.waiting) and scheduler.waiting[0].schedulable
        if not self._vote_prefill(want, any_point):
            return None
        outputs = self._prefill() if want else None
        if not self._vote_scheduled(outputs is not None):
            return None
        return outputs if outputs is not None else []

    def _vote_prefill(self, want: bool, any_point: bool) -> bool:
        """ANY: some rank wants a prefill; ALL: every rank does (a MAX all-reduce of "does not want" is 0)."""
        if any_point:
            return self._scheduler_vote(want) == 1
        return self._scheduler_vote(not want) == 0

    def _vote_scheduled(self, scheduled: bool) -> bool:
        return self._scheduler_vote(scheduled) == 1

    def _scheduler_vote(self, value: bool) -> int:
        """A MAX all-reduce over the DP group (the scheduler's votes), a collective with DP > 1."""
        group = PG.cpu_data_parallel_group() if self.zero_overhead_scheduling else PG.data_parallel_group()
        if group.size() <= 1:
            return int(value)
        import torch.distributed as dist

        tensor = torch.full((1,), int(value), dtype=torch.int64, device="cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        self.collectives += 1
        return int(tensor.item())

    def _kv_usage(self) -> float:
        scheduler = self.scheduler
        return (scheduler.num_gpu_blocks - scheduler.free_blocks) / scheduler.num_gpu_blocks

    def _never_fits(self, seq: Sequence) -> bool:
        scheduler = self.scheduler
        too_long = seq.get_prompt_len() > self.scheduler_config.prompt_limit
        return too_long or scheduler.blocks_for(seq.get_len() + 1) > scheduler.num_gpu_blocks - 1

    def _prefill(self) -> list[_Output] | None:
        """Admits waiting requests in order; ``None`` when it neither scheduled nor ignored any."""
        scheduler = self.scheduler
        records: list[_Output] = []
        while scheduler.waiting:
            seq = scheduler.waiting[0]
            if not seq.schedulable:
                break
            if self._never_fits(seq):
                scheduler.waiting.popleft()
                seq.status = SequenceStatus.FINISHED_IGNORED
                records.append(self._synthetic(seq))
                continue
            need = scheduler.blocks_for(seq.get_len() + 1)
            if scheduler.occupied_slots() >= self.scheduler_config.max_num_seqs or need > scheduler.free_blocks:
                break
            scheduler.waiting.popleft()
            scheduler.free_blocks -= need
            seq.blocks = need
            seq.num_cached_tokens = seq.get_len()  # the prefill computes the whole prompt
            seq.status = SequenceStatus.RUNNING
            scheduler.running.append(seq)
            records += self._emit(seq, 1, 1, 1)
        return records or None

    def _decode(self) -> list[_Output]:
        scheduler = self.scheduler
        nextn = self.nextn
        records: list[_Output] = []
        for seq in list(scheduler.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            accepted = (self.generate_step + seq.seq_id) % (nextn + 1) if nextn else 0
            count = 1 + accepted
            need = scheduler.blocks_for(seq.get_len() + count) - seq.blocks
            while need > scheduler.free_blocks and seq.status == SequenceStatus.RUNNING:
                victim = max(scheduler.running, key=Sequence.get_output_len)  # longest output goes first
                self._preempt(victim)
            if seq.status != SequenceStatus.RUNNING:
                continue
            if need > 0:
                scheduler.free_blocks -= need
                seq.blocks += need
            records += self._emit(seq, count, nextn + 1 if nextn else 1, accepted + 1)
        return records

    def _preempt(self, seq: Sequence) -> None:
        scheduler = self.scheduler
        scheduler.num_preempted += 1
        scheduler.running.remove(seq)
        scheduler.free(seq)
        if self.scheduler_config.stop_preempted_request or seq.sampling_params.so_args is not None:
            seq.status = SequenceStatus.FINISHED_PREEMPTED
            scheduler.ignored.append(seq)
        else:
            seq.status = SequenceStatus.WAITING  # recomputed later, generation continues
            seq.num_cached_tokens = 0
            scheduler.waiting.appendleft(seq)

    def _next_token(self, seq: Sequence) -> int:
        params = seq.sampling_params
        position = seq.get_output_len()
        echo = seq.echo
        if echo and (position < len(echo) or params.ignore_eos):
            return echo[position % len(echo)]
        if params.ignore_eos or (position == 0 and params.first_n_token_no_eos == 1):
            return self._filler
        return self.eos_id

    def _emit(self, seq: Sequence, count: int, draft_tok: int, accept_tok: int) -> list[_Output]:
        """Generates up to ``count`` tokens; stops early at EOS or a length limit."""
        params = seq.sampling_params
        records: list[_Output] = []
        for _ in range(count):
            token = self._next_token(seq)
            seq.output_token_ids.append(token)
            position = seq.get_output_len()
            if token == self.eos_id and not params.ignore_eos:
                seq.status = SequenceStatus.FINISHED_STOPPED
            elif position >= params.max_tokens or seq.get_len() > self.model_config.max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
            logprob = -0.25 * (position % 4)
            width = params.top_logprobs
            finished = seq.status != SequenceStatus.RUNNING
            records.append(
                _Output(
                    request_id=seq.request_id,
                    prompt_len=seq.get_prompt_len(),
                    token_id=token,
                    finish_reason=get_finished_reason(seq.status),
                    finished=finished,
                    token_logprobs=logprob,
                    top_logprobs=[logprob - j for j in range(width)],
                    top_token_ids=[(token + j) % self._vocab_size for j in range(width)],
                    num_output_tokens=position,
                    prompt_logprobs=self._prompt_logprobs(seq) if position == 1 and params.prompt_logprobs else [],
                )
            )
            if finished:
                self.scheduler.running.remove(seq)
                self.scheduler.free(seq)
                seq.holds_slot = True
                self.scheduler.retiring.append(seq)
                break
        records[-1].draft_tok = draft_tok
        records[-1].accept_tok = accept_tok
        return records

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[float]:
        """DeepInfer's prompt logprobs: ``prompt_len - 1`` floats on the prompt step's output (made-up values)."""
        return [-0.125 * (1 + i % 8) for i in range(seq.get_prompt_len() - 1)]

    def _synthetic(self, seq: Sequence) -> _Output:
        """The final output of a request that ends without generating: its token was never sampled."""
        return _Output(
            request_id=seq.request_id,
            prompt_len=seq.get_prompt_len(),
            token_id=seq.get_last_token_id(),
            finish_reason=get_finished_reason(seq.status),
            finished=True,
            token_logprobs=SYNTHETIC_LOGPROB,
            top_logprobs=[],
            top_token_ids=[],
            num_output_tokens=seq.get_output_len() + 1,
        )

    def _synthetic_outputs(self) -> list[_Output]:
        ignored = self.scheduler.ignored
        if not ignored:
            return []
        self.scheduler.ignored = []
        self.scheduler.retiring += ignored
        return [self._synthetic(seq) for seq in ignored]

    def _account(self, records: list[_Output]) -> None:
        """DeepInfer's completion counters; ``finished_payload`` is trimmed only by the stats logger."""
        finished = [r for r in records if r.finished]
        if finished:
            self.num_finished_completion += len(finished)
            output_len = sum(r.num_output_tokens for r in finished)
            prompt_len = sum(r.prompt_len for r in finished)
            self.finished_payload.append(
                (time.perf_counter(), (len(finished), output_len, prompt_len, 0), self.generate_step)
            )
        if self.log_stats:
            window = max(0, envs.DEEPINFER_LOGGING_INTERVAL_STEP)
            self.finished_payload = [e for e in self.finished_payload if self.generate_step - e[2] <= window]
