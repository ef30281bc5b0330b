"""Where a gateway keeps the state it owns on local disk (stored responses, batches) by default."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR_VARIABLE = "DEEPINFER_GATEWAY_STATE"
"""A folder of its own for the default SQLite stores; without it, ``$DEEPINFER_GATEWAY_CACHE`` or
``~/.cache/deepinfer-gateway``. The test suite points it at a folder per run, so its gateways never share stored
responses or batches with a gateway a developer runs on the same machine."""


def local_state_dir() -> Path:
    configured = os.environ.get(STATE_DIR_VARIABLE) or os.environ.get("DEEPINFER_GATEWAY_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "deepinfer-gateway"
