"""End to end with a gateway of its own per test: KV-cache pressure, and backends that cannot start.

``import deepinfer`` resolves to the TEST DOUBLE. DeepInfer allows one engine per process, so these gateways cannot
run while the shared one of ``test_gateway.py`` does; pytest finishes that module (and its gateway) first.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.config import GatewayConfig

from ...conftest import start_gateway, stop_gateway, wait_until
from .conftest import MAX_MODEL_LEN, deepinfer_on_path

MODEL = "deepseek-v4.1"


def test_kv_pressure_is_a_503_with_retry_after_or_an_error_frame(model_dir: Path) -> None:
    """DeepInfer stops the longest request when its KV cache runs out; OpenAI has no finish reason for that."""
    with deepinfer_on_path():
        config = GatewayConfig(
            backends=[
                {
                    "name": "deepinfer",
                    "kind": "deepinfer",
                    "model": str(model_dir),
                    "max_model_len": MAX_MODEL_LEN,
                    "gpu_memory_utilization": 0.0004,  # 40 KV blocks of 16 tokens: four long requests do not fit
                }
            ],
            models=[{"name": MODEL, "backends": ["deepinfer"]}],
        )
        running = start_gateway(config)
        try:
            from deepinfer._double import STEP_GATE

            def ask(stream: bool) -> tuple[int, dict[str, str], list[str]]:
                body = {"model": MODEL, "prompt": "fill the cache", "max_tokens": 200, "ignore_eos": True}
                with (
                    httpx.Client(base_url=running.base_url, timeout=30) as http,
                    http.stream("POST", "/v1/completions", json={**body, "stream": stream}) as response,
                ):
                    return response.status_code, dict(response.headers), list(response.iter_lines())

            for stream in (False, True):
                STEP_GATE.clear()  # hold the engine so all four requests are admitted together
                with ThreadPoolExecutor(4) as pool:
                    futures = [pool.submit(ask, stream) for _ in range(4)]
                    assert wait_until(lambda: running.driver_in_flight("deepinfer") == 4)
                    STEP_GATE.set()
                    results = [f.result() for f in futures]
                if not stream:
                    refused = [r for r in results if r[0] == 503]
                    assert refused and len(refused) < 4
                    assert all(r[1]["retry-after"] == "1" for r in refused)
                    assert all("insufficient_system_resource" in "".join(r[2]) for r in refused)
                else:
                    errors = [lines for _, _, lines in results if any('"error"' in line for line in lines)]
                    assert errors and len(errors) < 4
                    for lines in errors:
                        frame = next(orjson.loads(line[6:]) for line in lines if '"error"' in line)
                        assert frame["error"]["code"] == "insufficient_system_resource"
                        assert [line for line in lines if line][-1] == "data: [DONE]"
            metrics = httpx.get(f"{running.base_url}/metrics").text
            assert 'gateway_engine_preempted_requests_total{backend="deepinfer"} 0.0' not in metrics
            assert 'code="insufficient_system_resource"' in metrics
        finally:
            stop_gateway(running)


@pytest.mark.parametrize(
    ("device", "importable", "reason"),
    [("sm100", False, "deepinfer package cannot be imported"), ("sm90", True, "Hopper and older are refused")],
)
def test_backend_that_cannot_start_keeps_ready_at_503_with_the_reason(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, device: str, importable: bool, reason: str
) -> None:
    with deepinfer_on_path():
        monkeypatch.setenv("DEEPINFER_DOUBLE_DEVICE", device)
        if not importable:
            monkeypatch.setitem(sys.modules, "deepinfer", None)
        config = GatewayConfig(
            backends=[{"name": "gpu", "kind": "deepinfer", "model": str(model_dir), "max_model_len": MAX_MODEL_LEN}],
            models=[{"name": MODEL, "backends": ["gpu"]}],
        )
        running = start_gateway(config, wait_for="/health")
        try:
            assert wait_until(lambda: "start failed" in httpx.get(f"{running.base_url}/ready").text, timeout=30)
            ready = httpx.get(f"{running.base_url}/ready")
            assert ready.status_code == 503
            assert reason in ready.json()["backends"]["gpu"]["reason"]
            refused = httpx.post(f"{running.base_url}/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert refused.status_code == 503
        finally:
            stop_gateway(running)
