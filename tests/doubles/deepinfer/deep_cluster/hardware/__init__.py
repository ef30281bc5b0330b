"""TEST DOUBLE of ``deep_cluster.hardware``: the accelerator check DeepInfer's engine runs at construction.

The pretended device comes from ``DEEPINFER_DOUBLE_DEVICE`` (sm100, sm90, ascend950, none; default sm100).
"""

from __future__ import annotations

import os
from typing import Literal

AcceleratorKind = Literal["nvidia", "ascend", "cpu"]


def _device() -> str:
    return os.environ.get("DEEPINFER_DOUBLE_DEVICE", "sm100")


def accelerator_kind() -> AcceleratorKind:
    device = _device()
    if device.startswith("sm"):
        return "nvidia"
    if device.startswith("ascend"):
        return "ascend"
    return "cpu"


def is_sm_major_10() -> bool:
    return _device() == "sm100"


def get_bf16_tflops_limit() -> int:
    if accelerator_kind() == "ascend":
        return 432
    if is_sm_major_10():
        return 2250
    raise RuntimeError("unknown GPU type")
