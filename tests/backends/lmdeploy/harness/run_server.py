"""Runs LMDeploy's real ``lmdeploy serve api_server`` CLI with only the engine object replaced by the stub.

Usage (with the harness virtualenv's python): ``python run_server.py serve api_server MODEL_DIR --server-port N ...``.
Everything else (argument parsing, FastAPI routes and middlewares, validation, templates, detokenisation, parsers,
health monitor, metrics, error mapping) is LMDeploy's own code.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lmdeploy.archs
import lmdeploy.cli.serve
from lmdeploy.cli.entrypoint import run
from lmdeploy.serve.core.async_engine import AsyncEngine
from stub_engine import StubEngine


def _build_stub(self: AsyncEngine, model_path: str, backend_config: Any = None, **kwargs: Any) -> StubEngine:
    return StubEngine(self.tokenizer.model.model, backend_config)


def main() -> None:
    AsyncEngine._build_turbomind = _build_stub  # type: ignore[method-assign]
    AsyncEngine._build_pytorch = _build_stub  # type: ignore[method-assign]
    # The CLI would fall back to PyTorch because TurboMind's native library cannot load, and asks CUDA for the
    # GPU name to size the batch.
    lmdeploy.archs.autoget_backend = lambda *args, **kwargs: "turbomind"
    lmdeploy.cli.serve.get_max_batch_size = lambda device: 128
    run()


if __name__ == "__main__":
    main()
