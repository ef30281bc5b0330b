"""``kind: deepinfer`` under ``server.runtime.workers: 2``: the supervisor hosts the engines once, every front end
serves.

The gateway runs through its CLI (``deepinfer-gateway serve``) as a user runs it. The rank workers import the TEST
DOUBLEs of ``deepinfer`` and ``torch.distributed`` through ``PYTHONPATH`` (as in ``test_data_parallel.py``); the
front ends import neither: they load only the tokenizer and dispatch to the ranks the supervisor hosts.
``di2`` is a lockstep group of two DP ranks, ``di1`` a single engine, which must also live in a rank worker since
two front ends cannot each build an engine on the same devices.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from ...conftest import wait_until
from ...processes import descendants, free_port, front_ends, is_ready, ranks
from .conftest import DOUBLE_DIR, TORCH_DOUBLE_DIR
from .test_data_parallel import ENGINE_ENV, backend_config, restarts_in


def double_environment() -> dict[str, str]:
    """The environment the gateway's processes start with: the doubles importable by the rank workers."""
    path = os.pathsep.join([str(DOUBLE_DIR), str(TORCH_DOUBLE_DIR), os.environ.get("PYTHONPATH", "")])
    return {
        **os.environ,
        "PYTHONPATH": path.rstrip(os.pathsep),
        "DEEPINFER_DOUBLE_STEP_SECONDS": "0.003",
        "DEEPINFER_DOUBLE_COLLECTIVE_TIMEOUT": "30",
    }


def answer(base: str, model: str) -> str:
    """One chat through the openai SDK, on a new connection (so any front end may accept it); in chat mode, so
    its few tokens are content (a deepinfer backend thinks by default, as DeepSeek serves V4.1)."""
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        completion = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=6,
            seed=3,
            extra_body={"thinking": {"type": "disabled"}},
        )
    content = completion.choices[0].message.content
    assert completion.choices[0].finish_reason in ("stop", "length") and content
    return content


@contextlib.contextmanager
def serve_front_ends(tmp_path: Path, backends: list[dict[str, Any]]) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``deepinfer-gateway serve`` with two front ends and one model per backend; killed (with its tree) after."""
    port = free_port()
    config = {
        "server": {"http": {"port": port}, "runtime": {"workers": 2}},
        "backends": backends,
        "models": [{"name": b["name"], "backends": [b["name"]]} for b in backends],
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log = (tmp_path / "gateway.log").open("wb")
    command = [sys.executable, "-m", "gateway.cli", "serve", "-c", str(path)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=double_environment())
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()  # its front ends and rank workers follow it
            process.wait()


@pytest.fixture
def supervisor(model_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    backends = [
        backend_config(model_dir, "di2", 2, visible_devices="0,1"),
        backend_config(model_dir, "di1", 1, visible_devices="2"),
    ]
    with serve_front_ends(tmp_path, backends) as served:
        yield served


def test_front_ends_share_the_deepinfer_ranks_the_supervisor_hosts(
    supervisor: tuple[subprocess.Popen[bytes], str],
) -> None:
    process, base = supervisor
    assert wait_until(lambda: len(front_ends(process.pid)) == 2, timeout=60)
    assert wait_until(lambda: is_ready(base), timeout=60), "every backend ready: all ranks up"
    hosted = ranks(process.pid)
    assert len(hosted) == 3, "di2's two ranks and di1's engine, started once, by the supervisor"
    for front_end in front_ends(process.pid):
        assert not descendants(front_end), "a front end builds no engine of its own"
    ready = httpx.get(f"{base}/ready").json()["backends"]
    assert ready["di2"]["reason"].startswith("2/2 ranks up") and ready["di1"]["reason"].startswith("1/1 ranks up")

    # Each front end serves on its own: with the other one stopped, it accepts every new connection.
    first, second = sorted(front_ends(process.pid))
    for stopped in (second, first):
        os.kill(stopped, signal.SIGSTOP)
        try:
            for model in ("di2", "di1", "di2"):
                assert answer(base, model)
        finally:
            os.kill(stopped, signal.SIGCONT)

    # A front end killed: the other keeps serving from the same ranks, and the supervisor replaces it.
    os.kill(first, signal.SIGKILL)
    assert wait_until(lambda: first not in front_ends(process.pid), timeout=30)
    for model in ("di2", "di1", "di2", "di1"):
        assert answer(base, model)
    assert wait_until(lambda: len(front_ends(process.pid)) == 2, timeout=60), "the supervisor starts another"
    assert wait_until(lambda: is_ready(base), timeout=60)
    replacement = (front_ends(process.pid) - {second}).pop()
    os.kill(second, signal.SIGSTOP)  # the replacement alone: it dispatches to the ranks the others used
    try:
        for model in ("di2", "di1"):
            assert answer(base, model)
    finally:
        os.kill(second, signal.SIGCONT)
    assert replacement in front_ends(process.pid)
    assert ranks(process.pid) == hosted, "the ranks were neither restarted nor duplicated"

    metrics = httpx.get(f"{base}/metrics").text
    assert 'gateway_dp_rank_up{backend="di2",rank="1"} 1.0' in metrics
    assert 'gateway_dp_rank_up{backend="di1",rank="0"} 1.0' in metrics
    served = sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("gateway_requests_total{") and 'status="200"' in line and 'model="di' in line
    )
    assert served == 12, "a scrape sums the chats of every front end, the killed one's included"

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0
    assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in hosted), timeout=30)


def test_every_front_end_shows_why_the_ranks_it_shares_cannot_build_and_serves_the_rest(
    model_dir: Path, tmp_path: Path
) -> None:
    """Only the supervisor restarts hosted ranks, yet each front end's ``/ready`` shows DeepInfer's error, the
    restarts and the backoff (the ranks report them: ``FAILED``, then ``STARTING`` from the next incarnation), and
    the front ends serve the backend whose engine is fine meanwhile."""
    backends = [
        backend_config(
            model_dir, "hopper", 2, visible_devices="0,1", env={**ENGINE_ENV, "DEEPINFER_DOUBLE_DEVICE": "sm90"}
        ),
        backend_config(model_dir, "di1", 1, visible_devices="2"),
    ]
    with serve_front_ends(tmp_path, backends) as (process, base):
        assert wait_until(lambda: len(front_ends(process.pid)) == 2, timeout=60)

        def reasons() -> list[str]:  # new connections: the kernel spreads them over both front ends
            answers = []
            for _ in range(8):
                try:
                    answers.append(httpx.get(f"{base}/ready", timeout=10).json()["backends"]["hopper"]["reason"])
                except httpx.TransportError:
                    return []
            return answers

        def shown_everywhere() -> bool:
            seen = reasons()
            return bool(seen) and all("Hopper and older are refused" in r and restarts_in(r) >= 1 for r in seen)

        assert wait_until(shown_everywhere, timeout=90), reasons()
        ready = httpx.get(f"{base}/ready")
        assert ready.status_code == 503 and ready.json()["backends"]["di1"]["ready"]
        assert answer(base, "di1")
        metrics = httpx.get(f"{base}/metrics").text
        assert 'gateway_dp_rank_up{backend="hopper",rank="0"} 0.0' in metrics
