"""Fixtures for the DeepInfer binding: the ``deepinfer`` TEST DOUBLE on ``sys.path``, and a model directory.

The double (``tests/doubles/deepinfer``) is importable only inside ``deepinfer_on_path()``: it is put first on
``sys.path`` with every ``deepinfer`` / ``deep_cluster`` module purged before and after, and ``os.environ`` is
restored afterwards, since the binding sets engine variables process-wide before importing ``deepinfer``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken

from backends.config import DeepInferBackendConfig
from backends.deepinfer import startup
from backends.reference import load_or_build

DOUBLE_DIR = Path(__file__).resolve().parents[2] / "doubles" / "deepinfer"
MAX_MODEL_LEN = 256
OUT_OF_VOCAB_TOKEN = "<|place_holder_mm_span_0000|>"
"""Registered in the tokenizer above the model's vocabulary, as DeepInfer's multimodal placeholders are."""


def _purge() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("deepinfer", "deep_cluster"):
            del sys.modules[name]


@contextlib.contextmanager
def deepinfer_on_path() -> Iterator[None]:
    """Makes ``import deepinfer`` load the test double, fresh, for the duration of the block."""
    saved_env = dict(os.environ)
    _purge()
    sys.path.insert(0, str(DOUBLE_DIR))
    try:
        yield
    finally:
        sys.path.remove(str(DOUBLE_DIR))
        _purge()
        os.environ.clear()
        os.environ.update(saved_env)
        startup._release_process()  # a test that failed mid-way must not block the next engine


@pytest.fixture
def deepinfer_double() -> Iterator[None]:
    with deepinfer_on_path():
        yield


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-layout model directory for the double: config.json and the reference engine's tokenizer."""
    directory = tmp_path_factory.mktemp("deepinfer-model")
    tokenizer = load_or_build().tokenizer
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([AddedToken(OUT_OF_VOCAB_TOKEN, special=True, normalized=False)])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True, "add_eos_token": False}))
    config = {
        "model_type": "deepseek_v41",
        "dtype": "bfloat16",
        "text_config": {"vocab_size": vocab_size},
        "vision_config": {},
        "vl_aligner": {},
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def make_config(model_dir: Path, **overrides: Any) -> DeepInferBackendConfig:
    fields: dict[str, Any] = {"name": "deepinfer", "model": str(model_dir), "max_model_len": MAX_MODEL_LEN}
    fields.update(overrides)
    return DeepInferBackendConfig(**fields)
