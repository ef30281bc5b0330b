"""When DeepInfer's real scheduler admits a prefill, counted in engine steps: the timelines of ``../admission.py``
(the double's ``test_prefill_admission.py`` asserts the same numbers on the double).

DeepInfer reads its prefill intervals once per process (when ``deepinfer.config`` is imported): a single-rank
timeline with this session's values (``ENGINE_ENV``) runs in process; the others run each rank in a process of its
own, as background jobs started with the session.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from backends.deepinfer.environment import free_rendezvous_port

from ..admission import TIMELINES, Timeline, gather, play, spawn
from .conftest import ENGINE_ENV, FRESH_TIMELINE, Background, background_job, fresh_process_facts

READ_ONCE = (
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
    "DEEPINFER_USE_NEXTN_DECODE",
)
"""What DeepInfer reads once per process (at import, or on first use)."""


def in_session(timeline: Timeline) -> bool:
    return timeline.ranks == 1 and all(timeline.env.get(name) == ENGINE_ENV.get(name) for name in READ_ONCE)


def _job(timeline: Timeline) -> None:
    @background_job(f"timeline:{timeline.name}")
    def start(model_dir: Path) -> list[subprocess.Popen[str]]:
        inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env = {**inherited, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_rendezvous_port())}
        return spawn(timeline, model_dir, env)


def job_name(timeline: Timeline) -> str | None:
    """The background job that plays it; ``None``: in this process."""
    if in_session(timeline):
        return None
    return "fresh-process" if timeline.name == FRESH_TIMELINE else f"timeline:{timeline.name}"


def _case(timeline: Timeline) -> object:
    name = job_name(timeline)
    if name is not None and name.startswith("timeline:"):
        _job(timeline)
    marks = [] if name is None else [pytest.mark.background(name)]
    return pytest.param(timeline, id=timeline.name, marks=marks)


@pytest.mark.parametrize("timeline", [_case(t) for t in TIMELINES])
def test_deepinfer_admits_prefills_at_the_measured_steps(
    real_model_dir: Path, background: Background, timeline: Timeline
) -> None:
    """Each timeline's first and final output steps: see its ``doc`` (e.g. with DeepInfer's default interval a
    mid-decode arrival waits for decode step 70; with two ranks a lone rank's request waits for the ANY point, step
    100 by default, step 1 with ``DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL=1``)."""
    name = job_name(timeline)
    if name is None:
        played = play(timeline, str(real_model_dir))
    elif name == "fresh-process":
        played = fresh_process_facts(background)["timeline"]
    else:
        played = gather(background.processes(name))
    got = {request_id: (first, last) for request_id, (first, last) in played.items()}
    assert got == timeline.expected, timeline.doc
