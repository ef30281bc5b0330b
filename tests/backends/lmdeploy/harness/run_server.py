"""Runs LMDeploy's real ``lmdeploy serve api_server`` CLI with only the engine object replaced by the stub.

Usage (with the harness virtualenv's python): ``python run_server.py serve api_server MODEL_DIR --server-port N ...``.
Everything else (argument parsing, FastAPI routes and middlewares, validation, templates, detokenisation, parsers,
health monitor, metrics, error mapping) is LMDeploy's own code. The harness only watches from outside LMDeploy's
app: every HTTP request that carries W3C trace context is noted in the stub's event log (``event: "http"``), so
tests see the ``traceparent`` LMDeploy received.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lmdeploy.archs
import lmdeploy.cli.serve
import uvicorn
from lmdeploy.cli.entrypoint import run
from lmdeploy.serve.core.async_engine import AsyncEngine
from stub_engine import EventLog, StubEngine

_TRACE_HEADERS = {b"traceparent": "traceparent", b"tracestate": "tracestate"}


def _build_stub(self: AsyncEngine, model_path: str, backend_config: Any = None, **kwargs: Any) -> StubEngine:
    return StubEngine(self.tokenizer.model.model, backend_config)


def _noting_trace_context(app: Any, log: EventLog) -> Any:
    """LMDeploy's ASGI app, with each request's trace-context headers written to the event log."""

    async def noted(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            found = {_TRACE_HEADERS[k]: v.decode() for k, v in scope["headers"] if k in _TRACE_HEADERS}
            if found:
                log.write(event="http", path=scope["path"], **found)
        await app(scope, receive, send)

    return noted


def main() -> None:
    AsyncEngine._build_turbomind = _build_stub  # type: ignore[method-assign]
    AsyncEngine._build_pytorch = _build_stub  # type: ignore[method-assign]
    # The CLI would fall back to PyTorch because TurboMind's native library cannot load, and asks CUDA for the
    # GPU name to size the batch.
    lmdeploy.archs.autoget_backend = lambda *args, **kwargs: "turbomind"
    lmdeploy.cli.serve.get_max_batch_size = lambda device: 128
    serve_app = uvicorn.run
    log = EventLog(os.environ.get("STUB_EVENT_LOG"))
    uvicorn.run = lambda app, **kwargs: serve_app(_noting_trace_context(app, log), **kwargs)  # type: ignore[assignment]
    run()


if __name__ == "__main__":
    main()
