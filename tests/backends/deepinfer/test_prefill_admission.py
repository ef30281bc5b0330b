"""The TEST DOUBLE admits prefills as DeepInfer's real scheduler does: the timelines of ``admission.py``, measured
on the real engine (``real/test_prefill_admission.py`` asserts the same numbers there), played on the double.

Each rank is a process of its own with the ``deepinfer`` and ``torch.distributed`` doubles on ``PYTHONPATH``, so
the DP votes go through the double's checked collectives.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends.deepinfer.environment import free_rendezvous_port

from .admission import TIMELINES, Timeline, gather, spawn
from .conftest import DOUBLE_DIR, TORCH_DOUBLE_DIR


@pytest.mark.parametrize("timeline", TIMELINES, ids=[t.name for t in TIMELINES])
def test_the_double_admits_prefills_at_the_steps_deepinfer_does(model_dir: Path, timeline: Timeline) -> None:
    path = os.pathsep.join([str(DOUBLE_DIR), str(TORCH_DOUBLE_DIR), os.environ.get("PYTHONPATH", "")])
    env = {
        **os.environ,
        "PYTHONPATH": path.rstrip(os.pathsep),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_rendezvous_port()),
        "DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT": "30",
    }
    assert gather(spawn(timeline, model_dir, env)) == timeline.expected, timeline.doc
