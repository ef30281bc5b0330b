"""``deepinfer`` with ``data_parallel_size`` > 1: one DeepInfer rank per worker process, stepping in lockstep.

The workers import the TEST DOUBLEs of ``deepinfer`` and ``torch.distributed`` (via ``PYTHONPATH``): the double's
``has_unfinished_requests`` is a MAX all-reduce over the DP group and ``step`` and ``close`` are collectives, each
checked across the processes, so a rank calling a different collective than its peers fails the group loudly
(``CollectiveError``, a failed rank, failed requests) instead of passing by luck. ``di2`` has two ranks, ``di3``
three. The tests read the dispatcher's per-rank state (``driver.ranks``) to see where requests went.

Serving, spreading, aborts, a killed rank and shutdown with two ranks run on DeepInfer's real engine over gloo
(``real/test_data_parallel.py``); what stays here needs three ranks or tests the doubles themselves.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from ...conftest import RunningGateway, stop_gateway, wait_until
from ..workers.conftest import driver_of, holding_rank, one_model_per_backend, open_stream, start_with_ranks, steps
from .conftest import DOUBLE_DIR, TORCH_DOUBLE_DIR, deepinfer_on_path

MAX_MODEL_LEN = 1024
ENGINE_ENV = {
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1",
    "DEEPINFER_USE_NEXTN_DECODE": "0",
}
"""The documented DP setting: prefill at once even while the other ranks are idle (their votes would otherwise hold
a lone rank's request for 100 steps); one token per request per step, so a long request lasts many steps."""
STEP_SECONDS = "0.003"
"""Each double step sleeps this long, so a request of a few hundred tokens is still running when a test acts."""


@contextlib.contextmanager
def doubles_for_workers() -> Iterator[None]:
    """The doubles on this process's path and on every worker's ``PYTHONPATH`` (environment restored after)."""
    with deepinfer_on_path():
        path = os.pathsep.join([str(DOUBLE_DIR), str(TORCH_DOUBLE_DIR), os.environ.get("PYTHONPATH", "")])
        os.environ["PYTHONPATH"] = path.rstrip(os.pathsep)
        os.environ["DEEPINFER_DOUBLE_STEP_SECONDS"] = STEP_SECONDS
        os.environ["DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT"] = "30"
        yield


def backend_config(model_dir: Path, name: str, size: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": "deepinfer",
        "model": str(model_dir),
        "max_model_len": MAX_MODEL_LEN,
        "data_parallel_size": size,
        "visible_devices": ",".join(str(i) for i in range(size)),
        "env": ENGINE_ENV,
        **extra,
    }


def start(backends: list[dict[str, Any]]) -> RunningGateway:
    return start_with_ranks(one_model_per_backend(backends), ready_timeout=90)


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[RunningGateway]:
    with doubles_for_workers():
        running = start([backend_config(model_dir, "di2", 2), backend_config(model_dir, "di3", 3)])
        yield running
        stop_gateway(running)


@pytest.fixture(scope="module")
def http(served: RunningGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=60) as client:
        yield client


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


# ---- ranks, devices, rendezvous ----------------------------------------------------------------------------------


def test_each_rank_has_its_own_devices_and_all_meet_at_one_rendezvous(served: RunningGateway) -> None:
    for backend, size in (("di2", 2), ("di3", 3)):
        ranks = driver_of(served, backend).ranks
        environs = [environ_of(rank.pid) for rank in ranks if rank.pid is not None]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in environs] == [str(i) for i in range(size)]
        assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in environs}) == 1
    ports = {environ_of(driver_of(served, b).ranks[0].pid or 0)["MASTER_PORT"] for b in ("di2", "di3")}
    assert len(ports) == 2, "two DP groups must not share a rendezvous"


def test_the_gateway_reports_the_group_ready(http: httpx.Client) -> None:
    ready = http.get("/ready").json()["backends"]
    assert ready["di2"]["ready"] and ready["di2"]["reason"].startswith("2/2 ranks up")
    assert ready["di3"]["ready"] and ready["di3"]["reason"].startswith("3/3 ranks up")


# ---- lockstep ----------------------------------------------------------------------------------------------------


def test_idle_ranks_step_in_lockstep_with_the_busy_one(served: RunningGateway, http: httpx.Client) -> None:
    start_steps = steps(served, "di3")
    with open_stream(http, "di3", 60) as stream:
        next(stream)
        busy = holding_rank(served, "di3")
        rest = list(stream)
    assert rest[-1] == "[DONE]" and orjson.loads(rest[-2])["choices"][0]["finish_reason"] == "length"
    driver = driver_of(served, "di3")
    assert [r.outstanding for r in driver.ranks] == [0, 0, 0]
    # Every rank reports the same step count (idle ones ran placeholder steps), and at least the busy rank's 60.
    assert wait_until(lambda: len(set(steps(served, "di3"))) == 1 and steps(served, "di3")[busy] > start_steps[busy])
    assert steps(served, "di3")[0] - start_steps[0] >= 60
    assert all(r.state == "up" and r.restarts == 0 for r in driver.ranks), "no collective mismatch failed a rank"


# ---- the double's collectives ----------------------------------------------------------------------------------------

_RANK_SCRIPT = """
import os, sys
import numpy as np
from deepinfer.engine.arg_utils import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
rank, scenario, model = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
engine = LLMEngine.from_engine_args(
    EngineArgs(model=model, max_model_len=64, data_parallel_size=2, engine_rank=rank, gpu_memory_utilization=1.0)
)
if rank == 0:
    engine.add_request(user_id="u", request_id="r", sampling_params={"max_tokens": 2},
                       prompt_token_ids=np.array([5, 6, 7], dtype=np.int32))
try:
    if scenario == "lockstep":
        while engine.has_unfinished_requests():
            engine.step()
        engine.close()
        print("closed", engine.collectives)
    elif rank == 0:
        engine.has_unfinished_requests()
    else:
        engine.step()  # skipped has_unfinished_requests: a lockstep slip
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""


def run_two_ranks(model_dir: Path, scenario: str) -> list[tuple[int, str]]:
    with doubles_for_workers():
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1"}
        from backends.deepinfer.environment import free_rendezvous_port

        env["MASTER_PORT"] = str(free_rendezvous_port())
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", _RANK_SCRIPT, str(rank), scenario, str(model_dir)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(2)
        ]
        return [(p.wait(timeout=60), (p.stdout.read() if p.stdout else "")) for p in processes]


def test_double_ranks_in_lockstep_reduce_to_the_busy_ranks_answer_and_close_together(model_dir: Path) -> None:
    results = run_two_ranks(model_dir, "lockstep")
    assert [code for code, _ in results] == [0, 0], results
    counts = {out.strip() for _, out in results}
    assert len(counts) == 1 and next(iter(counts)).startswith("closed "), "both ranks made the same collectives"
    assert int(next(iter(counts)).split()[1]) > 3, "the idle rank stepped while rank 0 had work"


def test_double_fails_every_rank_loudly_when_one_skips_a_collective(model_dir: Path) -> None:
    results = run_two_ranks(model_dir, "slip")
    assert [code for code, _ in results] == [3, 3], results
    for _, out in results:
        assert "CollectiveError" in out and "ranks are in different collectives" in out
        # rank 1's step() begins with the scheduler's prefill vote (step 0 is an ALL point), as DeepInfer's does
        assert "LLMEngine.has_unfinished_requests" in out and "LLMEngine._scheduler_vote" in out


# ---- a rank that cannot build its engine ----------------------------------------------------------------------------


def restarts_in(reason: str) -> int:
    found = re.search(r"(\d+) restarts", reason)
    return int(found.group(1)) if found else 0


def test_ranks_that_cannot_build_their_engine_show_why_how_often_and_when_in_ready_and_metrics(
    model_dir: Path,
) -> None:
    """DeepInfer refuses the GPU (the double reports a Hopper): each rank's build fails. The gateway serves 503s and
    keeps restarting the group with backoff, and ``/ready`` says why (DeepInfer's own error, not an exit code), how
    many restarts so far and when the next one is; the metrics count them."""
    with doubles_for_workers():
        broken = backend_config(model_dir, "hopper", 2, env={**ENGINE_ENV, "DEEPINFER_DOUBLE_DEVICE": "sm90"})
        running = start_with_ranks(one_model_per_backend([broken]), ready_timeout=90, wait_for="/health")
        try:
            with httpx.Client(base_url=running.base_url, timeout=30) as http:

                def reason() -> str:
                    return str(http.get("/ready").json()["backends"]["hopper"]["reason"])

                def backing_off() -> bool:  # between two launches: down, waiting out its backoff
                    text = reason()
                    # rank 0's part runs up to rank 1's; DeepInfer's own message has semicolons of its own, and
                    # either rank may be the one that failed first (the other one is restarted with it)
                    rank_0 = text.partition("rank 0: ")[2].partition("; rank 1: ")[0]
                    return restarts_in(text) >= 2 and re.search(r"; restarting in \d+\.\d s", rank_0) is not None

                assert wait_until(backing_off, timeout=60), reason()
                ready = http.get("/ready")
                assert ready.status_code == 503
                text = ready.json()["backends"]["hopper"]["reason"]
                assert text.startswith("0/2 ranks up")
                assert "Hopper and older are refused" in text, "the engine's own error, from the rank"
                refused = http.post("/v1/completions", json={"model": "hopper", "prompt": "x", "max_tokens": 2})
                assert refused.status_code == 503
            assert running.metric("gateway_dp_rank_restarts_total", backend="hopper", rank="0") >= 2
            assert running.metric("gateway_dp_rank_up", backend="hopper") == 0
            assert wait_until(lambda: running.metric("gateway_dp_rank_backoff_seconds", backend="hopper") > 0)
        finally:
            stop_gateway(running)
