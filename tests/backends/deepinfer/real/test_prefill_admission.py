"""When DeepInfer's real scheduler admits a prefill, counted in engine steps, each case in a process of its own.

DeepInfer reads its prefill intervals once per process (when ``deepinfer.config`` is imported), so each case starts
a fresh harness interpreter that builds its engine with the binding's ``start_engine``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.deepinfer.environment import free_rendezvous_port

from .conftest import run_script

SINGLE_RANK = """
import json, sys
import numpy as np
from backends.config import DeepInferBackendConfig
from backends.deepinfer.startup import start_engine

model, env = sys.argv[1], json.loads(sys.argv[2])
env["DEEPINFER_USE_NEXTN_DECODE"] = "0"
config = DeepInferBackendConfig(name="d", model=model, max_model_len=256, max_num_seqs=8, env=env)
engine = start_engine(config)
prompt = np.asarray(engine.tokenizer.encode("alpha beta").ids, dtype=np.int32)
engine.add_request("u", "busy", {"max_tokens": 400, "ignore_eos": True}, prompt)
for _ in range(6):
    engine.step()
engine.add_request("u", "late", {"max_tokens": 2, "ignore_eos": True}, prompt)
steps = 0
while not any(o.request_id == "late" for o in engine.step()):
    steps += 1
    assert steps < 300
print(json.dumps({"late_first_token_after_steps": steps + 1}))
engine.close()
"""

TWO_RANKS = """
import json, sys
import numpy as np
from backends.config import DeepInferBackendConfig
from backends.deepinfer.startup import start_engine

rank, model, env = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
env["DEEPINFER_USE_NEXTN_DECODE"] = "0"
config = DeepInferBackendConfig(
    name="d", model=model, max_model_len=256, max_num_seqs=8, data_parallel_size=2, visible_devices="0,1", env=env
)
engine = start_engine(config.model_copy(update={"visible_devices": str(rank)}), engine_rank=rank)
prompt = np.asarray(engine.tokenizer.encode("alpha beta").ids, dtype=np.int32)
if rank == 0:  # rank 1 stays idle: its steps are placeholders in lockstep with rank 0's
    engine.add_request("u", "r0", {"max_tokens": 3, "ignore_eos": True}, prompt)
first = None
for step in range(110):  # the same number of steps on both ranks: each is a collective
    if engine.step() and first is None:
        first = step
print(json.dumps({"rank": rank, "first_output_at_step": first}))
engine.close()
"""


def _single_rank(model_dir: Path, env: dict[str, str]) -> int:
    out = run_script(SINGLE_RANK, str(model_dir), json.dumps(env))
    return json.loads(out.strip().splitlines()[-1])["late_first_token_after_steps"]


def test_mid_decode_arrival_waits_for_deepinfers_default_interval(real_model_dir: Path) -> None:
    """Without the gateway's setting, DeepInfer tries a prefill only every 70 decode steps."""
    assert _single_rank(real_model_dir, {}) >= 60


def test_documented_interval_prefills_a_mid_decode_arrival_at_the_next_step(real_model_dir: Path) -> None:
    assert _single_rank(real_model_dir, {"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"}) == 1


def _two_ranks(model_dir: Path, env: dict[str, str]) -> dict[int, int | None]:
    import os
    import subprocess
    import sys
    import textwrap

    from .conftest import REPO

    rendezvous = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_rendezvous_port())}
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(TWO_RANKS), str(rank), str(model_dir), json.dumps(env)],
            env=rendezvous,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    firsts: dict[int, int | None] = {}
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, f"rank failed:\n{out}\n{err}"
        result = json.loads(out.strip().splitlines()[-1])
        firsts[result["rank"]] = result["first_output_at_step"]
    return firsts


@pytest.mark.parametrize(
    ("env", "first_step"),
    [
        ({"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1"}, 100),
        ({"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1", "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1"}, 1),
    ],
    ids=["any-interval-default", "any-interval-1"],
)
def test_a_rank_whose_peers_are_idle_prefills_at_the_any_interval(
    real_model_dir: Path, env: dict[str, str], first_step: int
) -> None:
    """Two DP ranks over gloo: rank 0 has a request, rank 1 none. All ranks must want a prefill at the ALL
    interval; one alone waits for the ANY interval (DeepInfer's default 100 steps), so the deployment sets both."""
    assert _two_ranks(real_model_dir, env) == {0: first_step, 1: None}
