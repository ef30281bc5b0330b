"""Makes DeepInfer 0.1.0's ``csrc`` build for the CPU: three edits, each behind ``DEEPINFER_CPU_STUB``.

Usage: ``python patch.py <csrc>``. Each edit names the exact text it replaces and fails if that text is not there
exactly once, so a different DeepInfer release is refused instead of half-patched.

- the default device of host-to-device copies is the CPU (``get_default_device``);
- host buffers are not pinned: pinned memory needs a CUDA context (two places).
"""

from __future__ import annotations

import sys
from pathlib import Path

PINNED_BUFFER = "torch::TensorOptions(dtype).pinned_memory(true)"
EDITS: tuple[tuple[str, str, str], ...] = (
    (
        "cuda_utils.hpp",
        "#ifdef WITH_NPU\n    return torch::kPrivateUse1;",
        "#if defined(DEEPINFER_CPU_STUB)\n    return torch::kCPU;\n"
        "#elif defined(WITH_NPU)\n    return torch::kPrivateUse1;",
    ),
    (
        "engine/input_metadata/prepare_tensor_input_base.cpp",
        f"torch::TensorOptions pinned(torch::ScalarType dtype) {{ return {PINNED_BUFFER}; }}",
        "#ifdef DEEPINFER_CPU_STUB\n"
        "torch::TensorOptions pinned(torch::ScalarType dtype) { return torch::TensorOptions(dtype); }\n"
        "#else\n"
        f"torch::TensorOptions pinned(torch::ScalarType dtype) {{ return {PINNED_BUFFER}; }}\n"
        "#endif",
    ),
    (
        "engine/input_metadata/block_load_plan.cpp",
        "torch::TensorOptions(torch::kInt32).pinned_memory(true));",
        "torch::TensorOptions(torch::kInt32)\n#ifndef DEEPINFER_CPU_STUB\n        .pinned_memory(true)\n#endif\n    );",
    ),
)


def patch(csrc: Path) -> None:
    for relative, before, after in EDITS:
        path = csrc / relative
        text = path.read_text()
        if text.count(before) != 1:
            raise SystemExit(f"{path}: expected exactly one {before!r}; not DeepInfer 0.1.0's source?")
        path.write_text(text.replace(before, after))


if __name__ == "__main__":
    patch(Path(sys.argv[1]))
