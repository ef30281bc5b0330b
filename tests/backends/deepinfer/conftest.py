"""Fixtures for the DeepInfer binding: the ``deepinfer`` TEST DOUBLE on ``sys.path``, and a model directory.

The double (``tests/doubles/deepinfer``, with the ``torch`` double its ``_C`` needs loaded first, as the real
extension does) is importable only inside ``deepinfer_on_path()``: both are put first on ``sys.path`` with every
``deepinfer`` / ``deep_cluster`` / ``torch`` module purged before and after, and ``os.environ`` is restored
afterwards, since the binding sets engine variables process-wide before importing ``deepinfer``.

The binding's tests against DeepInfer's real engine live in ``real/`` and run under the harness (``harness/``).
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
TORCH_DOUBLE_DIR = DOUBLE_DIR.parent / "torch"
MAX_MODEL_LEN = 256
collect_ignore = ["harness"] + ([] if os.environ.get("DEEPINFER_HARNESS") == "1" else ["real"])
"""``real/`` runs only in the DeepInfer harness session that ``test_real_engine.py`` starts."""
OUT_OF_VOCAB_TOKEN = "<|place_holder_mm_span_0000|>"
"""Registered in the tokenizer above the model's vocabulary, as DeepInfer's multimodal placeholders are."""


def _purge() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in ("deepinfer", "deep_cluster", "torch"):
            del sys.modules[name]


@contextlib.contextmanager
def deepinfer_on_path() -> Iterator[None]:
    """Makes ``import deepinfer`` load the test double, fresh, for the duration of the block."""
    saved_env = dict(os.environ)
    if getattr(sys.modules.get("torch"), "IS_TEST_DOUBLE", True) is not True:
        raise RuntimeError("a real torch is loaded in this process: the deepinfer double cannot run next to it")
    _purge()
    sys.path[:0] = [str(DOUBLE_DIR), str(TORCH_DOUBLE_DIR)]
    try:
        yield
    finally:
        sys.path.remove(str(DOUBLE_DIR))
        sys.path.remove(str(TORCH_DOUBLE_DIR))
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
