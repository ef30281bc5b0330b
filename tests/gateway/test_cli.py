"""The ``deepinfer-gateway`` command as a user runs it: ``serve`` with defaults and a file, ``config check``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai

from ..processes import free_port
from ..waiting import wait_ready

CLI = [sys.executable, "-m", "gateway.cli"]


def test_serve_with_no_config_serves_the_reference_engine_on_the_given_port(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen([*CLI, "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_ready(f"{base}/ready", timeout=120), "the gateway did not become ready"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["deepinfer-reference"]
        reply = client.chat.completions.create(
            model="deepinfer-reference", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content is not None
    finally:
        process.terminate()
        process.wait(timeout=30)  # uvicorn re-raises SIGTERM after a graceful shutdown
    lines = (tmp_path / "serve.log").read_text().splitlines()
    assert any("Application shutdown complete" in line for line in lines), "SIGTERM shuts down gracefully"
    assert any('"path":"/v1/chat/completions"' in line and '"status":200' in line for line in lines)


def test_config_check_prints_the_resolved_config_with_the_environment_applied(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "backends:\n  - name: ref\n    kind: reference\n    max_model_len: 1024\n"
        "models:\n  - name: my-model\n    backends: [ref]\n"
    )
    env = {**os.environ, "GATEWAY_SERVER__HTTP__PORT": "9123"}
    result = subprocess.run([*CLI, "config", "check", str(config)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    assert "port: 9123" in result.stdout
    assert "max_model_len: 1024" in result.stdout


def test_config_check_names_every_bad_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "server:\n  http:\n    port: seventy\nbackends:\n  - name: ref\n    kind: reference\n    max_num_seqs: 0\n"
        "models:\n  - name: m\n    backends: [ref]\n"
    )
    result = subprocess.run([*CLI, "config", "check", str(config)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "server.http.port" in result.stderr
    assert "backends[0].max_num_seqs" in result.stderr


def test_serve_refuses_a_config_that_references_an_unknown_backend(tmp_path: Path) -> None:
    config = tmp_path / "dangling.yaml"
    config.write_text("backends:\n  - name: ref\n    kind: reference\nmodels:\n  - name: m\n    backends: [nope]\n")
    result = subprocess.run([*CLI, "serve", "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown backend 'nope'" in result.stderr


SECRET_CONFIG = (
    "server:\n  auth:\n    api_keys:\n      - sk-plain-client-key-1\n"
    "      - key: sk-named-client-key-2\n        name: team-a\n"
    "  tracing:\n    headers: {authorization: 'Bearer sk-otlp-token-6'}\n"
    "backends:\n  - name: ref\n    kind: reference\n"
    "  - name: lm\n    kind: lmdeploy\n    urls: ['http://user:sk-url-password-5@127.0.0.1:1']\n"
    "    api_key: sk-upstream-key-3\n"
    "models:\n  - name: m\n    backends: [ref]\n"
)
SECRETS = (
    "sk-plain-client-key-1",
    "sk-named-client-key-2",
    "sk-upstream-key-3",
    "sk-admin-from-env-4",
    "sk-url-password-5",
    "Bearer sk-otlp-token-6",
    "sk-budgets-password-6",
    "sk-responses-password-7",
)
STORE_ENV = {  # as deploy/kubernetes/scale-out gives them
    "GATEWAY_SERVER__STORES__STATE_STORE": "redis://gateway:sk-budgets-password-6@budgets:6379/0",
    "GATEWAY_SERVER__STORES__RESPONSES_STORE": "redis://gateway:sk-responses-password-7@responses:6379/0",
}


def test_config_check_redacts_every_key_unless_asked_to_show_them(tmp_path: Path) -> None:
    config = tmp_path / "secrets.yaml"
    config.write_text(SECRET_CONFIG)
    env = {**os.environ, "GATEWAY_SERVER__AUTH__ADMIN_API_KEY": "sk-admin-from-env-4", **STORE_ENV}
    result = subprocess.run([*CLI, "config", "check", str(config)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    for secret in SECRETS:
        assert secret not in result.stdout
    assert result.stdout.count("<redacted>") == len(SECRETS)
    assert "name: team-a" in result.stdout, "the rest of the configuration is still shown"
    assert "http://user:<redacted>@127.0.0.1:1" in result.stdout
    shown = subprocess.run(
        [*CLI, "config", "check", "--show-secrets", str(config)], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0, shown.stderr
    assert all(secret in shown.stdout for secret in SECRETS)
