"""Builds a DeepInfer engine on the calling thread, which is the engine driver's thread.

Order matters: the model is resolved first (cheap, clear errors), then the process environment is set, then
``deepinfer`` is imported (it reads part of that environment at import), then the accelerator is checked (DeepInfer
itself checks only after loading the weights, minutes later), then the engine is built.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

from backends.config import DeepInferBackendConfig
from backends.deepinfer.engine import DeepInferEngine
from backends.deepinfer.environment import apply_environment, engine_environment
from backends.deepinfer.model_path import resolve_model_dir

logger = logging.getLogger(__name__)

_IMPORT_TIME_VARIABLES = ("DEEPINFER_PREFILL_ATTEMPT_INTERVAL", "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL")


class DeepInferStartupError(RuntimeError):
    """DeepInfer cannot run here; the message says why and what to change."""


class DeepInferModules(NamedTuple):
    """The parts of the ``deepinfer`` package the binding uses."""

    version: str
    envs: Any
    EngineArgs: Any
    LLMEngine: Any
    RequestOutput: Any


_owner_lock = threading.Lock()
_owner: str | None = None
"""The backend whose engine lives in this process: DeepInfer runs one engine (one DP rank) per process."""


def start_engine(config: DeepInferBackendConfig, *, engine_rank: int = 0) -> DeepInferEngine:
    """Constructs the engine for ``config`` (DP rank ``engine_rank`` of ``config.data_parallel_size``); raises
    ``DeepInferStartupError`` with the reason if it cannot."""
    _claim_process(config.name)
    try:
        return _start(config, engine_rank)
    except BaseException:
        _release_process()
        raise


def _start(config: DeepInferBackendConfig, engine_rank: int) -> DeepInferEngine:
    try:
        model_dir = resolve_model_dir(config.model, config.revision)
        tokenizer_dir = resolve_model_dir(config.tokenizer, what="tokenizer") if config.tokenizer else None
        env = engine_environment(config, os.environ)
    except (OSError, ValueError) as exc:
        raise DeepInferStartupError(f"backend {config.name!r}: {exc}") from exc
    if "deepinfer" in sys.modules:
        logger.warning(
            "deepinfer was imported before backend %s set its environment: variables read at import (%s) keep "
            "their earlier values",
            config.name,
            ", ".join(_IMPORT_TIME_VARIABLES),
        )
    apply_environment(env)
    modules = import_deepinfer()
    check_accelerator(config)
    args = engine_args(config, modules.EngineArgs, model_dir, tokenizer_dir, engine_rank=engine_rank)
    logger.info(
        "starting DeepInfer %s for backend %s (DP rank %d of %d) from %s",
        modules.version,
        config.name,
        engine_rank,
        config.data_parallel_size,
        model_dir,
    )
    try:
        llm_engine = modules.LLMEngine.from_engine_args(args)
    except Exception as exc:
        raise DeepInferStartupError(f"backend {config.name!r}: DeepInfer failed to start: {exc!r}") from exc
    try:
        engine = DeepInferEngine(
            llm_engine,
            modules.RequestOutput,
            version=modules.version,
            batch_invariant=bool(modules.envs.DEEPINFER_BATCH_INVARIANT),
            speculative_tokens=int(modules.envs.DEEPINFER_USE_NEXTN_DECODE),
            on_close=_release_process,
        )
        if engine.max_model_len != config.max_model_len:
            raise DeepInferStartupError(
                f"DeepInfer runs with max_model_len {engine.max_model_len}, not the configured {config.max_model_len}"
            )
    except BaseException as exc:
        if config.data_parallel_size == 1:
            llm_engine.close()
        # else no close(): it is a collective the other ranks are not in. The worker process exits and the
        # dispatcher restarts the group.
        if isinstance(exc, Exception):
            raise DeepInferStartupError(f"backend {config.name!r}: {exc}") from exc
        raise
    return engine


def import_deepinfer() -> DeepInferModules:
    """Imports ``deepinfer`` now (never at gateway import), turning a missing or broken install into a clear error."""
    try:
        # torch first: deepinfer._C is a torch C++ extension built without an rpath to torch's libraries (libc10.so
        # and friends), which it finds only once torch has loaded them. deepinfer's __init__ never imports torch,
        # and its own modules always import torch before _C.
        import deepinfer
        import torch  # noqa: F401
        from deepinfer._C.engine import RequestOutput
        from deepinfer.engine.arg_utils import EngineArgs
        from deepinfer.engine.llm_engine import LLMEngine
    except (ImportError, OSError, SyntaxError) as exc:  # OSError: a shared library of torch or CUDA is missing
        python = (
            "" if sys.version_info >= (3, 12) else f" DeepInfer needs Python 3.12; this is {platform.python_version()}."
        )
        raise DeepInferStartupError(
            f"the deepinfer package cannot be imported ({exc!r}). Build and install DeepInfer (pip install "
            f"'deepinfer-gateway[deepinfer]', see docs/deepinfer.md) on a machine with its accelerator.{python}"
        ) from exc
    return DeepInferModules(
        getattr(deepinfer, "__version__", "unknown"), deepinfer.envs, EngineArgs, LLMEngine, RequestOutput
    )


def check_accelerator(config: DeepInferBackendConfig) -> None:
    """Refuses unsupported hardware before the weights load; DeepInfer's own check runs only after loading."""
    try:
        from deep_cluster.hardware import accelerator_kind, get_bf16_tflops_limit
    except ImportError as exc:
        logger.warning("cannot check the accelerator before loading (%s); DeepInfer checks it after loading", exc)
        return
    kind = accelerator_kind()
    if kind != config.accelerator:
        found = "no GPU or NPU" if kind == "cpu" else f"{kind!r} devices"
        raise DeepInferStartupError(
            f"backend {config.name!r} is configured for accelerator {config.accelerator!r}, but this machine has "
            f"{found}; DeepInfer runs on NVIDIA SM100 GPUs and Huawei Ascend 950 NPUs"
        )
    try:
        get_bf16_tflops_limit()
    except RuntimeError as exc:
        raise DeepInferStartupError(
            f"backend {config.name!r}: DeepInfer runs on NVIDIA SM100 GPUs (compute capability 10.x) and Ascend 950 "
            f"NPUs; the GPU here is not SM100 (Hopper and older are refused by DeepInfer: {exc})"
        ) from exc


def engine_args(
    config: DeepInferBackendConfig, engine_args_class: Any, model: Path, tokenizer: Path | None, *, engine_rank: int = 0
) -> Any:
    """``EngineArgs`` from the config: every size explicit, above all ``max_model_len`` (DeepInfer's default: 4096)."""
    return engine_args_class(
        model=str(model),
        served_model_name=config.served_model_name or config.name,
        tokenizer=str(tokenizer) if tokenizer is not None else None,
        trust_remote_code=config.trust_remote_code,
        load_format=config.load_format,
        seed=config.seed,
        max_model_len=config.max_model_len,
        data_parallel_size=config.data_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_parallel_size=config.expert_parallel_size,
        engine_rank=engine_rank,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        disable_log_stats=not config.log_stats,
        stop_preempted_request=config.stop_preempted_request,
        chunked_prefill=config.chunked_prefill,
    )


def _claim_process(name: str) -> None:
    global _owner
    with _owner_lock:
        if _owner is not None:
            raise DeepInferStartupError(
                f"backend {name!r}: backend {_owner!r} already runs a DeepInfer engine in this process; DeepInfer "
                "runs one engine per process (CUDA_VISIBLE_DEVICES and its environment are process-wide)"
            )
        _owner = name


def _release_process() -> None:
    global _owner
    with _owner_lock:
        _owner = None
