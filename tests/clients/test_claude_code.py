"""Claude Code's CLI in print mode against a real gateway on the reference engine: ``claude -p`` completes a turn,
exits 0 and prints the text the model wrote, and reaches nothing but the gateway.

Claude Code sends one streamed ``/v1/messages?beta=true`` request of some 25,000 tokens here (its system prompt and
21 tools, in the reference tokenizer's tokens) with ``max_tokens: 32000``, ``thinking: adaptive`` with
``display: omitted``, ``output_config.effort``, ``context_management`` and a deferred tool: the engine's context is
64k tokens, and the output is cut where the context ends. What the gateway streamed is recorded on the way out (a
pure ASGI wrapper around the real app), so the test knows the model's text. ``strace`` sees every network system
call of Claude Code and its children: none may go to an address outside loopback.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.app import create_app
from gateway.config import GatewayConfig

from ..waiting import wait_ready
from .claude_code import OFFLINE_ENV, claude_binary

pytestmark = pytest.mark.timeout(900)  # the first run on a machine installs Claude Code (npm, about 370 MB)

MODEL = "deepinfer-reference"
MAIN, SMALL = "claude-sonnet-4-6", "claude-haiku-4-5"
KEY = "sk-claude-code-test"
CONTEXT = 65536
ADDRESS = re.compile(r"sin6?_addr=inet(?:_pton\(AF_INET6, )?(?:_addr)?\(\"([^\"]+)\"")


class StreamRecorder:
    """Wraps the app and keeps the body of every /v1/messages response it sends."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/messages"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    self.bodies.append(b"".join(chunks))
            await send(message)

        await self.app(scope, receive, recording)


def streamed_text(body: bytes) -> str:
    """The text deltas of an Anthropic event stream."""
    text = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            event = orjson.loads(line[6:])
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                text.append(event["delta"]["text"])
    return "".join(text)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, StreamRecorder]]:
    config = GatewayConfig(
        server={"auth": {"api_keys": [KEY]}},
        backends=[{"name": "reference", "kind": "reference", "max_model_len": CONTEXT}],
        models=[{"name": MODEL, "aliases": [MAIN, SMALL], "backends": ["reference"]}],
    )
    recorder = StreamRecorder(create_app(config))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(recorder, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert wait_ready(f"{base_url}/ready"), "the gateway did not become ready"
    yield base_url, recorder
    server.should_exit = True
    thread.join(timeout=30)


def test_claude_code_print_mode_completes_a_turn_and_prints_the_models_text(
    served: tuple[str, StreamRecorder], tmp_path: Path
) -> None:
    base_url, recorder = served
    claude = claude_binary()
    strace = shutil.which("strace")
    assert strace is not None, "this test watches Claude Code's network calls with strace (Debian package strace)"
    home = tmp_path / "home"  # a fresh user: no login, no settings, nothing cached
    home.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": KEY,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": SMALL,
        **OFFLINE_ENV,
    }
    trace = tmp_path / "network.trace"
    done = subprocess.run(
        [strace, "-f", "-qq", "-e", "trace=%network", "-o", str(trace), str(claude), "-p", "say hi", "--model", MAIN],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"claude exited {done.returncode}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    assert len(recorder.bodies) >= 1, "Claude Code sent no /v1/messages request"
    said = streamed_text(recorder.bodies[-1])
    assert said.strip(), "the model wrote no text"
    assert done.stdout.strip() == said.strip()
    addresses = set(ADDRESS.findall(trace.read_text()))
    assert addresses, "strace saw no network call at all: the trace is not watching Claude Code"
    assert addresses <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, f"Claude Code reached beyond loopback: {addresses}"
