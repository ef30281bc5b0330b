"""Prefill admission timelines, played on the ``deepinfer`` TEST DOUBLE and on DeepInfer's real engine alike.

A timeline adds requests to given DP ranks at given steps, steps every rank the same number of times (each step
is a collective with DP > 1) and records, per request, the step of its first output and of its final one. The
expected results (``Timeline.expected``) were measured on DeepInfer 0.1.0's real scheduler
(``real/test_prefill_admission.py`` asserts them there); ``test_prefill_admission.py`` asserts the same on the
double, so the two are shown to agree.

What they pin (DeepInfer's NORMAL engine): a prefill is tried only when ``decode_step`` is a multiple of
``DEEPINFER_PREFILL_ATTEMPT_INTERVAL`` (ALL vote: every DP rank must want one) or a non-zero multiple of
``DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL`` (ANY vote: one rank suffices); a second vote checks that some rank did
schedule something, and the other ranks then run an empty prompt step in lockstep (their decodes skip a step).
``decode_step`` is reset by every prompt step and counts every decode step, idle placeholders included.

Each rank runs in a process of its own (``python -m tests.backends.deepinfer.admission SPEC RANK MODEL``), built by
the binding's ``start_engine``: DeepInfer reads the intervals once per process, when ``deepinfer.config`` is
imported. ``play`` also runs in a process whose DeepInfer was imported with the timeline's environment already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
NO_MTP = {"DEEPINFER_USE_NEXTN_DECODE": "0"}
"""One token per request per step: the real engine's stub model has no speculative decoding."""


@dataclass(frozen=True)
class Timeline:
    name: str
    ranks: int
    env: dict[str, str]
    steps: int
    adds: list[tuple[int, int, str, int]]
    """``(step, rank, request id, max_tokens)``: the request is added to that rank just before that step."""
    expected: dict[str, tuple[int, int]]
    """Request id -> (step of its first output, step of its final output), counted from 0."""
    max_num_seqs: int = 8
    doc: str = field(default="", compare=False)


TIMELINES = [
    Timeline(
        name="one-rank-default-intervals",
        ranks=1,
        env={**NO_MTP},
        steps=80,
        adds=[(0, 0, "busy", 60), (6, 0, "late", 2)],
        expected={"busy": (0, 60), "late": (71, 73)},
        doc="DeepInfer's default (70): a request added mid-decode waits for decode_step 70; idle steps count.",
    ),
    Timeline(
        name="one-rank-interval-1",
        ranks=1,
        env={**NO_MTP, "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"},
        steps=30,
        adds=[(0, 0, "busy", 20), (6, 0, "late", 2), (6, 0, "full", 3)],
        max_num_seqs=2,
        expected={"busy": (0, 22), "late": (6, 8), "full": (10, 13)},
        doc="The documented setting: a mid-decode arrival is prefilled at the next step; a request that finds "
        "every slot taken waits for one to free, and the running ones decode meanwhile.",
    ),
    Timeline(
        name="one-rank-interval-1-no-zos",
        ranks=1,
        env={**NO_MTP, "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1", "DEEPINFER_ZERO_OVERHEAD_SCHEDULING": "0"},
        steps=30,
        adds=[(0, 0, "busy", 20), (6, 0, "late", 2), (6, 0, "full", 3)],
        max_num_seqs=2,
        expected={"busy": (0, 21), "late": (6, 7), "full": (9, 11)},
        doc="The same without zero-overhead scheduling: outputs come from the step that sampled them.",
    ),
    Timeline(
        name="two-ranks-any-interval-default",
        ranks=2,
        env={**NO_MTP, "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"},
        steps=130,
        adds=[(0, 0, "alone", 3), (120, 0, "both0", 2), (120, 1, "both1", 2)],
        expected={"alone": (100, 103), "both0": (120, 122), "both1": (120, 122)},
        doc="Rank 0 wants a prefill, idle rank 1 does not: every ALL vote fails until the ANY point (100 steps); "
        "when both want one, the ALL vote passes at once.",
    ),
    Timeline(
        name="two-ranks-any-interval-1",
        ranks=2,
        env={**NO_MTP, "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1", "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1"},
        steps=30,
        adds=[(0, 0, "a", 8), (0, 0, "waits", 2), (4, 1, "b", 2)],
        max_num_seqs=1,
        expected={"a": (1, 10), "waits": (12, 14), "b": (4, 6)},
        doc="The documented DP setting: one rank's request is prefilled at the next ANY point (step 1). Rank 0 "
        "wants a prefill for `waits` at every step but has no free slot: the second vote sends the group back to "
        "decoding. When rank 1 schedules `b`, rank 0 runs an empty prompt step in lockstep, so `a` skips a step.",
    ),
]
"""The measured cases; ``expected`` values come from DeepInfer's real engine."""

BY_NAME = {timeline.name: timeline for timeline in TIMELINES}


def play(timeline: Timeline, model: str, rank: int = 0) -> dict[str, list[int]]:
    """Builds this rank's engine with the binding, plays the timeline and returns ``{request id: [first, last]}``
    for the requests of this rank; closes the engine."""
    import numpy as np

    from backends.config import DeepInferBackendConfig
    from backends.deepinfer.startup import start_engine

    devices = ",".join(str(i) for i in range(timeline.ranks))
    config = DeepInferBackendConfig(
        name="admission",
        model=model,
        max_model_len=256,
        max_num_seqs=timeline.max_num_seqs,
        data_parallel_size=timeline.ranks,
        visible_devices=devices,
        env=timeline.env,
    )
    if timeline.ranks > 1:
        config = config.model_copy(update={"visible_devices": str(rank)})
    engine = start_engine(config, engine_rank=rank)
    try:
        prompt = np.asarray(engine.tokenizer.encode("alpha beta").ids, dtype=np.int32)
        seen: dict[str, list[int]] = {}
        for step in range(timeline.steps):
            for at, on_rank, request_id, max_tokens in timeline.adds:
                if at == step and on_rank == rank:
                    params = {"max_tokens": max_tokens, "ignore_eos": True}
                    assert engine.add_request("u", request_id, params, prompt) is not None
            for output in engine.step():
                first_last = seen.setdefault(output.request_id, [step, -1])
                if output.finished:
                    first_last[1] = step
        return seen
    finally:
        engine.close()


def spawn(
    timeline: Timeline, model: Path, env: dict[str, str], python: str = sys.executable
) -> list[subprocess.Popen[str]]:
    """One process per rank (``env``: the whole environment, rendezvous included), started now."""
    spec = json.dumps(asdict(timeline))
    return [
        subprocess.Popen(
            [python, "-m", "tests.backends.deepinfer.admission", spec, str(rank), str(model)],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(timeline.ranks)
    ]


def gather(processes: list[subprocess.Popen[str]], timeout: float = 180) -> dict[str, tuple[int, int]]:
    """Every rank's results, merged; fails with a rank's output if it exited non-zero."""
    merged: dict[str, tuple[int, int]] = {}
    for process in processes:
        out, err = process.communicate(timeout=timeout)
        if process.returncode != 0:
            raise AssertionError(f"a rank failed ({process.returncode}):\n{out}\n{err}")
        for request_id, (first, last) in json.loads(out.strip().splitlines()[-1]).items():
            merged[request_id] = (first, last)
    return merged


def _main() -> None:
    raw = json.loads(sys.argv[1])
    raw["adds"] = [tuple(add) for add in raw["adds"]]
    raw["expected"] = {k: tuple(v) for k, v in raw["expected"].items()}
    timeline = Timeline(**raw)
    result = play(timeline, sys.argv[3], rank=int(sys.argv[2]))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # nothing of the engine's process-wide state needs tearing down


if __name__ == "__main__":
    _main()
