"""Runs DeepInfer 0.1.0's real ``LLMEngine`` on a CPU: its model runner replaced by a stub, nothing else of it.

Installed by ``sitecustomize.py`` next to this file (this directory on ``PYTHONPATH``) in every harness process,
before anything is imported, so that the binding under test does its own imports in its own order: nothing here
imports torch or deepinfer. Each change is applied right after the module it changes has been imported
(``_AfterImport``), so DeepInfer still reads its environment at import exactly as it would in production.

What is replaced, and why (everything else runs as shipped: ``LLMEngine``, ``Worker.execute_model_step`` with
zero-overhead scheduling, the C++ ``Scheduler`` / ``BlockManager`` / ``RequestOutputPool``, ``init_dist`` over
gloo, ``close()`` and its barriers):

- GPU-only libraries that DeepInfer's model and kernel modules import (``deep_ep``, ``deep_gemm``, ``tilelang``,
  ``tile_kernels``, ``flash_mla``): empty modules; nothing of theirs runs on the engine's path here.
- ``torch.cuda.Event`` / ``current_device`` / ``Tensor.cuda``: host equivalents (no CUDA context).
- ``PLATFORM.distributed_backend``: gloo for every group (NCCL needs GPUs).
- ``deep_cluster.hardware``: reports one SM100 GPU (2250 BF16 TFLOPS), as the production hardware gate expects.
- Process groups: a fresh set for each engine built in the process (``_patch_parallel_state``).
- The model: ``load_model_config`` gives a tiny text-only config with the model directory's vocabulary size, the
  architecture lookup a class without a multimodal mapper, and ``ModelRunner`` is ``StubModelRunner``: each request
  "samples" its prompt back, token by token after the first (BOS), then EOS (id 1). The worker's GPU set-up
  (device binding, memory profiling, the KV cache) is replaced by host tensors of ``HARNESS_KV_BLOCKS`` blocks.

Knobs: ``DEEPINFER_HARNESS_KV_BLOCKS`` (default 1024 blocks of 64 tokens); ``DEEPINFER_HARNESS_FORWARD_SECONDS``
(default 0), how long each forward of the stub model takes, so a test can keep a request running while it acts.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

GPU_ONLY_MODULES = (
    "deep_ep",
    "deep_gemm",
    "tilelang",
    "tilelang.language",
    "tile_kernels",
    "tile_kernels.torch",
    "flash_mla",
    "flash_mla.flash_mla_interface",
)
EOS = 1
BF16_TFLOPS = 2250
STUB_ARCHITECTURE = "HarnessStubForCausalLM"


class _GpuOnlyModule(types.ModuleType):
    """Any attribute is a ``MagicMock``: module-level decorators and constants of DeepInfer's kernel modules
    evaluate; nothing of these libraries is called on the engine's path here."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``patches[name](module)`` once module ``name`` has executed, before its importer sees it."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, patch: Callable[[types.ModuleType], None]) -> None:
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, get_source, ...
        return getattr(self.loader, name)


# ---- host shims -----------------------------------------------------------------------------------------------


class HostEvent:
    """``torch.cuda.Event`` on the host clock: recorded, synchronized and timed without a device."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        return None

    def elapsed_time(self, end: HostEvent) -> float:
        return ((end.recorded_at or 0.0) - (self.recorded_at or 0.0)) * 1000.0


def _patch_torch(torch: types.ModuleType) -> None:
    torch.cuda.Event = HostEvent  # type: ignore[attr-defined]
    torch.cuda.current_device = lambda: 0  # type: ignore[attr-defined]
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]


def _patch_hardware(hardware: types.ModuleType) -> None:
    hardware.accelerator_kind = lambda **_: "nvidia"  # type: ignore[attr-defined]
    hardware.get_bf16_tflops_limit = lambda: BF16_TFLOPS  # type: ignore[attr-defined]


def _patch_platform(platform: types.ModuleType) -> None:
    """The GPU platform on the host: gloo process groups, no host-memory registration with CUDA. (Patched on the
    class: ``deepinfer.PLATFORM`` is built lazily, and touching it early would import torch early.)"""
    gpu = platform.PlatformGPU  # type: ignore[attr-defined]
    gpu.distributed_backend = "gloo"
    gpu.get_distributed_options = lambda self: None
    gpu.pin_host_memory = lambda self, tensor: None
    gpu.unpin_host_memory = lambda self, ptr: None


# ---- the model ------------------------------------------------------------------------------------------------


def tiny_model_config(model: str) -> Any:
    """A text-only config: the model directory's vocabulary, no layers (nothing here computes attention)."""
    from deepinfer import AttrDict

    config = json.loads((Path(model) / "config.json").read_text())
    vocab_size = int(config.get("text_config", config).get("vocab_size"))
    moe = AttrDict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=64)
    gpt = AttrDict(
        num_hidden_layers=0,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=vocab_size,
        head_dim=64,
        q_lora_rank=32,
        o_lora_rank=32,
        o_groups=1,
        window_size=(128, 0),
        use_fp4_sparse_kv=False,
        hc_mult=1,
        moe=moe,
    )
    return AttrDict(architecture=STUB_ARCHITECTURE, gpt=gpt)


def _patch_config(config: types.ModuleType) -> None:
    config.load_model_config = tiny_model_config  # type: ignore[attr-defined]


PROMPTS: dict[str, list[int]] = {}
"""Prompt token ids by request id, recorded as requests are added: what the stub model echoes."""


class StubModelRunner:
    """The model: a forward that does nothing and a sampler that returns the prompt, then EOS."""

    use_cuda_graph = False
    dflash_use_cuda_graph = False

    def __init__(self, model_config: Any, parallel_config: Any, scheduler_config: Any, *args: Any, **kwargs: Any):
        self.vocab_size: int = model_config.get_vocab_size()
        self.sampled: dict[str, int] = {}
        self.forwards: list[tuple[bool, list[str]]] = []
        """(is_prompt, request ids) of each forward, placeholders included: what tests count steps with."""
        self.forward_seconds = float(os.environ.get("DEEPINFER_HARNESS_FORWARD_SECONDS", "0"))

    def load_model(self, skip_load: bool = False) -> None:
        return None

    def destroy_cuda_graphs(self) -> None:
        return None

    def execute_main_model(self, seq_metadata_list: list[Any], kv_caches: Any, **kwargs: Any) -> Any:
        from deepinfer.worker.model_runner import MainModelOutput

        is_prompt = bool(seq_metadata_list[0].is_prompt)
        self.forwards.append((is_prompt, [m.request_id for m in seq_metadata_list]))
        metadata = types.SimpleNamespace(is_prompt=is_prompt, num_reqs=len(seq_metadata_list))
        if self.forward_seconds:
            time.sleep(self.forward_seconds)  # the model's compute time, not synchronisation
        return MainModelOutput(model_output=None, input_metadata=metadata)

    def execute_sample(self, seq_metadata_list: list[Any], input_metadata: Any, model_output: Any, kv_caches: Any):
        import torch
        from deepinfer.sequence import SampledInfo, SamplerOutput

        tokens = [self._next_token(m.request_id) for m in seq_metadata_list]
        ids = torch.tensor(tokens, dtype=torch.int32)
        sampled = SampledInfo(bs=len(tokens), token_ids=ids, token_logprobs=torch.zeros(len(tokens)))
        output = SamplerOutput(sampled_token=sampled, post_funcs=[], sampled_token_ids_gpu=ids)
        if input_metadata.is_prompt:
            output.prompt_logprobs = [None] * len(tokens)  # no request here asks for prompt logprobs
        return output

    def _next_token(self, request_id: str) -> int:
        count = self.sampled.get(request_id, 0) + 1
        self.sampled[request_id] = count
        prompt = PROMPTS.get(request_id, [])
        return prompt[count] if count < len(prompt) else EOS

    def post_process(self, seq_metadata_list: list[Any], sampler_output: Any, is_prompt: bool) -> None:
        """``ModelRunner.post_process`` without its CUDA timer."""
        from deepinfer._C.engine import update_prompt_logprobs

        for function in sampler_output.post_funcs:
            function()
        sampler_output.post_funcs.clear()
        if is_prompt:
            sampler_output.prompt_logprobs = update_prompt_logprobs(seq_metadata_list, sampler_output.prompt_logprobs)

    def _placeholder_seq_metadata(self, is_prompt: bool) -> Any:
        from deepinfer.worker.model_runner import ModelRunner

        return ModelRunner._placeholder_seq_metadata(self, is_prompt)  # type: ignore[arg-type]


def _patch_worker_base(base: types.ModuleType) -> None:
    """The worker without a GPU: no device binding, host tensors for its cache, the stub model."""
    import torch

    worker = base.WorkerBase  # type: ignore[attr-defined]
    base.ModelRunner = StubModelRunner  # type: ignore[attr-defined]
    worker._init_torch = lambda self: None
    worker.init_model = lambda self: self.set_random_seed_with_rank()

    def profile_num_available_blocks(self: Any) -> int:
        blocks = int(os.environ.get("DEEPINFER_HARNESS_KV_BLOCKS", "1024"))
        self.cache_config.num_gpu_blocks = blocks
        return blocks

    def init_cache_engine(self: Any) -> None:
        from deepinfer.worker.cache_engine import get_num_state_slots

        cache = self.cache_config
        cache.num_state_seqs = get_num_state_slots(self.model_config.max_num_seqs)
        cache.bytes_of_state_per_seqs = 64
        cache.bytes_per_block = 64
        self.cache_engine = types.SimpleNamespace(
            gpu_states=torch.zeros((cache.num_state_seqs, cache.bytes_of_state_per_seqs), dtype=torch.uint8),
            gpu_blocks=torch.zeros((cache.num_gpu_blocks, cache.bytes_per_block), dtype=torch.uint8),
        )

    worker.profile_num_available_blocks = profile_num_available_blocks
    worker.init_cache_engine = init_cache_engine


def _patch_parallel_state(parallel_state: types.ModuleType) -> None:
    """DeepInfer caches its process groups per process (``_split_group_cached``, an ``lru_cache``) and never clears
    the cache when ``close()`` destroys the world: a second engine in one process gets the dead groups and fails to
    start. The tests build many engines in one process, so the harness clears the cache for each new engine, unless
    ``DEEPINFER_HARNESS_KEEP_GROUP_CACHE=1`` (the test that shows DeepInfer's own behaviour)."""
    init_parallel_groups = parallel_state.init_parallel_groups  # type: ignore[attr-defined]

    def fresh_init_parallel_groups(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get("DEEPINFER_HARNESS_KEEP_GROUP_CACHE") != "1":
            parallel_state._split_group_cached.cache_clear()  # type: ignore[attr-defined]
        return init_parallel_groups(*args, **kwargs)

    parallel_state.init_parallel_groups = fresh_init_parallel_groups  # type: ignore[attr-defined]


def _patch_llm_engine(llm_engine: types.ModuleType) -> None:
    engine = llm_engine.LLMEngine  # type: ignore[attr-defined]
    llm_engine._get_model_architecture = lambda model_config: type(STUB_ARCHITECTURE, (), {})  # type: ignore[attr-defined]
    add_request = engine.add_request

    def recording_add_request(self: Any, *args: Any, **kwargs: Any) -> Any:
        prompt = kwargs.get("prompt_token_ids", args[3] if len(args) > 3 else None)
        request_id = kwargs.get("request_id", args[1] if len(args) > 1 else None)
        if request_id is not None and prompt is not None:
            PROMPTS[str(request_id)] = [int(t) for t in prompt]
        return add_request(self, *args, **kwargs)

    engine.add_request = recording_add_request


def install() -> None:
    for name in GPU_ONLY_MODULES:
        module = _GpuOnlyModule(name)
        module.__path__ = []  # type: ignore[attr-defined]
        sys.modules.setdefault(name, module)
    sys.meta_path.insert(
        0,
        _AfterImport(
            {
                "torch": _patch_torch,
                "deep_cluster.hardware": _patch_hardware,
                "deepinfer.platform": _patch_platform,
                "deepinfer.config": _patch_config,
                "deepinfer.model_executor.parallel_utils.parallel_state": _patch_parallel_state,
                "deepinfer.worker.base": _patch_worker_base,
                "deepinfer.engine.llm_engine": _patch_llm_engine,
            }
        ),
    )
