"""SIGTERM drains: streams in flight finish (up to server.runtime.drain_seconds), then the rest are cut and engines "
"close."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from ..conftest import MODEL, wait_until
from ..processes import free_port
from ..waiting import wait_ready


def _serve(
    tmp_path: Path, drain_seconds: float, probe_port: int | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    port = free_port()
    config = tmp_path / "drain.yaml"
    config.write_text(
        f"server: {{runtime: {{drain_seconds: {drain_seconds}}}, "
        f"http: {{probe_port: {'null' if probe_port is None else probe_port}}}}}\n"
        "backends:\n  - {name: reference, kind: reference, timing: {decode_seconds_per_step: 0.02}}\n"
        f"models:\n  - {{name: {MODEL}, backends: [reference]}}\n"
    )
    log = tmp_path / "serve.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    if wait_ready(f"{base}/ready", timeout=120):
        return process, base, log
    process.kill()
    raise RuntimeError("gateway did not start")


def _stream_then_sigterm(
    process: subprocess.Popen[bytes], base: str, max_tokens: int, while_draining: Callable[[], None] = lambda: None
) -> list[str]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    data: list[str] = []
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    if len(data) == 3:
                        process.send_signal(signal.SIGTERM)
                        while_draining()
    except httpx.HTTPError:
        pass  # a stream cut at the drain deadline ends without a clean HTTP ending
    return data


def test_sigterm_lets_a_stream_in_flight_finish_and_refuses_new_connections(tmp_path: Path) -> None:
    probe_port = free_port()
    probe = f"http://127.0.0.1:{probe_port}"
    process, base, log = _serve(tmp_path, drain_seconds=30, probe_port=probe_port)
    seen: dict[str, object] = {}

    def probe_while_draining() -> None:
        """The probe listener keeps answering through the drain: /ready says so, /health stays 200."""
        draining = wait_until(lambda: httpx.get(f"{probe}/ready", timeout=5).status_code == 503, timeout=30)
        seen["ready"] = httpx.get(f"{probe}/ready", timeout=5).json()["status"] if draining else None
        seen["health"] = httpx.get(f"{probe}/health", timeout=5).status_code

    try:
        assert httpx.get(f"{probe}/ready", timeout=5).status_code == 200
        data = _stream_then_sigterm(process, base, max_tokens=100, while_draining=probe_while_draining)
        assert seen == {"ready": "draining", "health": 200}
        assert data[-1] == "[DONE]", "the stream was not cut"
        assert orjson.loads(data[-2])["usage"]["completion_tokens"] == 100
        try:
            refused = httpx.get(f"{base}/health", timeout=2).status_code
        except httpx.TransportError:
            refused = None
        assert refused is None, "a draining gateway takes no new connections"
        assert process.wait(timeout=30) is not None
    finally:
        process.kill()
    assert "Application shutdown complete" in log.read_text()


def test_streams_still_running_at_the_drain_deadline_are_cut_and_the_engine_closes(tmp_path: Path) -> None:
    process, base, log = _serve(tmp_path, drain_seconds=0.5)
    try:
        started = time.monotonic()
        data = _stream_then_sigterm(process, base, max_tokens=1000)  # 20 s of decoding if nothing cut it
        assert "[DONE]" not in data
        process.wait(timeout=30)
        assert time.monotonic() - started < 15
    finally:
        process.kill()
    assert "Application shutdown complete" in log.read_text()
