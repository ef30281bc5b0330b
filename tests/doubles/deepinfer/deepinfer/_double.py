"""Controls of the TEST DOUBLE that the real ``deepinfer`` does not have; tests only."""

from __future__ import annotations

import os
import threading

STEP_GATE = threading.Event()
"""``step()`` waits on this before doing anything; clear it to hold the engine while requests queue up."""
STEP_GATE.set()

BLOCK_SIZE = 16
"""Tokens per KV block."""


def device() -> str:
    """The accelerator the double pretends to run on: sm100 (default), sm90 (Hopper), ascend950 or none."""
    return os.environ.get("DEEPINFER_DOUBLE_DEVICE", "sm100")


def kv_blocks_at_full_memory() -> int:
    return int(os.environ.get("DEEPINFER_DOUBLE_KV_BLOCKS", "100000"))


def idle_cpus() -> int:
    return int(os.environ.get("DEEPINFER_DOUBLE_IDLE_CPUS", "8"))


def step_seconds() -> float:
    """``DEEPINFER_DOUBLE_STEP_SECONDS``: how long each ``step()`` takes (default 0), to hold requests across
    processes, where ``STEP_GATE`` cannot reach."""
    return float(os.environ.get("DEEPINFER_DOUBLE_STEP_SECONDS", "0"))
