"""DeepInfer with ``data_parallel_size`` N > 1: one engine per DP rank, each in its own worker process.

DeepInfer runs one ``LLMEngine`` per DP rank per OS process, with its own ``engine_rank`` and its own devices,
and the ranks meet through torch.distributed (``MASTER_ADDR`` / ``MASTER_PORT``). Its ``has_unfinished_requests``
(a MAX all-reduce on the DP group), ``step`` and ``close`` are collectives, so the ranks run under the workers'
lockstep loop (``backends.workers.worker``). The gateway side (``rank_environment``, ``load_tokenizer``) decides
each rank's devices and rendezvous before the process starts, since CUDA must never see other devices; the worker
side (``build_rank_engine``) builds the engine on the worker's main thread. See docs/deepinfer.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from backends.config import DeepInferBackendConfig
from backends.deepinfer.environment import free_rendezvous_port
from backends.deepinfer.model_path import resolve_model_dir

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    from backends.workers.launch import WorkerPlan
    from backends.workers.spec import RankContext, RankEngine

BOS = "<｜begin▁of▁sentence｜>"
RELEASE_PLACEHOLDERS = tuple(f"<|place_holder_mm_span_{i:04d}|>" for i in range(21))
"""Special tokens DeepInfer's release tokenizer policy registers after the vocabulary (fact sheet E)."""


def all_devices(config: DeepInferBackendConfig, environ: Mapping[str, str]) -> list[str]:
    """Every device the DP group uses, rank 0's first: the config's list, the gateway's own, or 0..cp x dp - 1."""
    size = config.context_parallel_size * config.data_parallel_size
    listed = config.visible_devices or environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None and config.accelerator == "ascend":
        listed = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    devices = [d.strip() for d in listed.split(",") if d.strip()] if listed is not None else list(map(str, range(size)))
    if len(devices) < size:
        raise ValueError(
            f"backend {config.name!r}: {len(devices)} visible devices ({','.join(devices)}) for "
            f"data_parallel_size {config.data_parallel_size} x context_parallel_size {config.context_parallel_size}"
        )
    return devices[:size]


def rank_devices(config: DeepInferBackendConfig, rank: int) -> str:
    """Rank ``rank``'s own ``context_parallel_size`` devices (driver first), from the resolved ``visible_devices``."""
    assert config.visible_devices is not None, "resolved by data_parallel_options() in the gateway"
    cp = config.context_parallel_size
    return ",".join(config.visible_devices.split(",")[rank * cp : (rank + 1) * cp])


def data_parallel_options(config: DeepInferBackendConfig, environ: Mapping[str, str]) -> dict[str, Any]:
    """The options every rank validates: the config with ``visible_devices`` resolved once, in the gateway.

    Resolved here rather than in the worker because a worker sees only its own devices (``rank_environment``).
    """
    resolved = config.model_copy(update={"visible_devices": ",".join(all_devices(config, environ))})
    return resolved.model_dump(mode="json")


class RankEnvironment:
    """``WorkerPlan.rank_env``: each rank's devices and the group's rendezvous, set before its Python starts.

    With ``master_port`` unset a free port is chosen whenever rank 0 is launched: the dispatcher launches a
    lockstep group together, rank 0 first, so every rank of one launch gets the same port and a relaunched group
    never meets at a port its killed predecessor may still hold.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.config = DeepInferBackendConfig.model_validate(options)
        self.port: int | None = self.config.master_port

    def __call__(self, rank: int) -> dict[str, str]:
        config = self.config
        if config.master_port is None and (rank == 0 or self.port is None):
            self.port = free_rendezvous_port()
        devices = rank_devices(config, rank)
        env = {"CUDA_VISIBLE_DEVICES": devices, "MASTER_ADDR": config.master_addr, "MASTER_PORT": str(self.port)}
        if config.accelerator == "ascend":
            env["ASCEND_RT_VISIBLE_DEVICES"] = devices
        return env


class NodeRankEnvironment:
    """``WorkerPlan.rank_env`` for the ranks one node of several runs (``deepinfer-gateway ranks``): rank r gets its
    share of this node's devices, counted from the node's first rank, and every rank of every node meets at one
    rendezvous, ``master_addr`` (rank 0's node) and a fixed ``master_port``."""

    def __init__(self, config: DeepInferBackendConfig, first_rank: int, devices: list[str], port: int) -> None:
        self.config = config
        self.first_rank = first_rank
        self.devices = devices
        self.port = port

    def __call__(self, rank: int) -> dict[str, str]:
        cp = self.config.context_parallel_size
        slot = rank - self.first_rank
        devices = ",".join(self.devices[slot * cp : (slot + 1) * cp])
        env = {"CUDA_VISIBLE_DEVICES": devices, "MASTER_ADDR": self.config.master_addr, "MASTER_PORT": str(self.port)}
        if self.config.accelerator == "ascend":
            env["ASCEND_RT_VISIBLE_DEVICES"] = devices
        return env


def node_worker_plan(
    config: DeepInferBackendConfig, ranks: range, environ: Mapping[str, str], master_addr: str | None = None
) -> WorkerPlan:
    """The plan a node runs ``ranks`` of the group with: the node's own devices (``visible_devices``, else its
    ``CUDA_VISIBLE_DEVICES``, else 0..n-1), each rank built as DP rank ``rank`` of ``data_parallel_size``.

    A group on several nodes needs a fixed ``master_port``: ranks on different hosts must agree on it without
    talking first. A node that runs every rank may pick a free one.
    """
    from backends.workers.launch import WorkerPlan

    if master_addr is not None:
        config = config.model_copy(update={"master_addr": master_addr})
    port = config.master_port
    if port is None:
        if len(ranks) != config.data_parallel_size:
            raise ValueError(f"backend {config.name!r}: ranks on several nodes meet at one rendezvous; set master_port")
        port = free_rendezvous_port()
    listed = config.visible_devices or environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None and config.accelerator == "ascend":
        listed = environ.get("ASCEND_RT_VISIBLE_DEVICES")
    needed = config.context_parallel_size * len(ranks)
    devices = [d.strip() for d in listed.split(",") if d.strip()] if listed else list(map(str, range(needed)))
    if len(devices) < needed:
        raise ValueError(
            f"backend {config.name!r}: this node has {len(devices)} visible devices ({','.join(devices)}) for "
            f"{len(ranks)} ranks x context_parallel_size {config.context_parallel_size}"
        )
    # The workers take their devices from CUDA_VISIBLE_DEVICES (``_own_devices``): the config's list, if any, is
    # this node's, not the group's.
    options = config.model_copy(update={"visible_devices": None}).model_dump(mode="json")
    return WorkerPlan(
        size=config.data_parallel_size,
        factory="backends.deepinfer.ranks:build_rank_engine",
        options=options,
        lockstep=config.data_parallel_size > 1,
        rank_env=NodeRankEnvironment(config, ranks.start, devices[:needed], port),
        keys=config.rank_keys,
    )


def load_tokenizer(config: DeepInferBackendConfig) -> Tokenizer:
    """The gateway encodes prompts and decodes outputs itself: the model directory's ``tokenizer.json``, with the
    placeholder tokens DeepInfer's release policy adds, so its ids match what the in-process engine would use."""
    from tokenizers import AddedToken, Tokenizer

    directory = resolve_model_dir(config.tokenizer, what="tokenizer") if config.tokenizer else None
    directory = directory or resolve_model_dir(config.model, config.revision)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    missing = [t for t in RELEASE_PLACEHOLDERS if tokenizer.token_to_id(t) is None]
    if missing:
        tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    tokenizer.post_processor = _begin_with_bos(tokenizer)
    return tokenizer


def _begin_with_bos(tokenizer: Tokenizer) -> TemplateProcessing:
    """DeepInfer's release policy forces ``add_bos_token=True``: ``encode(text)`` starts with BOS (id 0) whatever
    ``tokenizer_config.json`` says, as the fast tokenizer's post-processor does once that flag is set."""
    from tokenizers.processors import TemplateProcessing

    bos_id = tokenizer.token_to_id(BOS)
    if bos_id is None:
        raise ValueError(f"the tokenizer has no {BOS}, which DeepInfer requires at id 0")
    return TemplateProcessing(single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)])


class TorchDataParallelGroup:
    """The worker loop's stop agreement: a MAX all-reduce on DeepInfer's own CPU (gloo) DP group.

    The same group DeepInfer's ``has_unfinished_requests`` reduces over, so the agreement needs no rendezvous of
    its own; it is taken only while the group is idle, in the same iteration on every rank.
    """

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist
        from deepinfer.model_executor.parallel_utils.parallel_state import PG

        self._torch = torch
        self._dist = dist
        self._group = PG.cpu_data_parallel_group()

    def all_reduce_max(self, value: int, op: str) -> int:
        tensor = self._torch.full((1,), value, dtype=self._torch.int64)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MAX, group=self._group)
        return int(tensor.item())

    def close(self) -> None:
        """Nothing: DeepInfer's ``close()`` tears the process groups down."""


def build_rank_engine(context: RankContext) -> RankEngine:
    """Runs in worker process ``context.rank``, on its main thread: that rank's engine and, with several ranks, its
    DP group.

    No ``LockstepEngine`` wrapper: DeepInfer's own ``has_unfinished_requests``, ``step`` and ``close`` are the
    collectives the lockstep loop is written for. A single rank (``data_parallel_size`` 1, hosted in a worker so
    that several front ends share it) has nothing to keep in step.
    """
    from backends.deepinfer.startup import start_engine
    from backends.workers.spec import RankEngine

    config = DeepInferBackendConfig.model_validate(context.options)
    if config.data_parallel_size != context.size:
        raise ValueError(f"rank {context.rank}: configured for {config.data_parallel_size} ranks, not {context.size}")
    if context.size > 1 and not context.lockstep:
        raise ValueError("DeepInfer's data-parallel ranks must run in lockstep")
    devices = _own_devices(config, context.rank)
    engine = start_engine(config.model_copy(update={"visible_devices": devices}), engine_rank=context.rank)
    # No engine.close() if this fails: close is a collective the other ranks are not in. The process exits and
    # the dispatcher restarts the group.
    return RankEngine(engine, TorchDataParallelGroup() if context.size > 1 else None)


def _own_devices(config: DeepInferBackendConfig, rank: int) -> str:
    """The rank's devices: its share of the resolved ``visible_devices`` (which its ``CUDA_VISIBLE_DEVICES`` must
    match), or, for ranks a node launches (``visible_devices`` unset), the ``CUDA_VISIBLE_DEVICES`` it was given."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if config.visible_devices is None:
        if not given or len(given.split(",")) != config.context_parallel_size:
            raise ValueError(
                f"rank {rank}: CUDA_VISIBLE_DEVICES={given!r} must list its context_parallel_size "
                f"({config.context_parallel_size}) devices"
            )
        return given
    devices = rank_devices(config, rank)
    if given not in (None, devices):
        raise ValueError(f"rank {rank}: CUDA_VISIBLE_DEVICES={given}, but its devices are {devices}")
    return devices
