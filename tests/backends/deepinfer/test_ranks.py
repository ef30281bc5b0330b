"""Pieces of the data-parallel mode that run in the gateway process: its tokenizer, and start-up failure cleanup."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tokenizers import Tokenizer

from backends.deepinfer import startup
from backends.deepinfer.ranks import BOS, load_tokenizer

from .conftest import make_config


def test_gateway_tokenizer_begins_with_bos_as_deepinfer_forces_it(model_dir: Path, tmp_path: Path) -> None:
    """DeepInfer's release policy sets ``add_bos_token=True`` whatever ``tokenizer_config.json`` says; the DP
    gateway tokenizes completions prompts itself, so it must prepend BOS as the in-process engine's tokenizer does."""
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    raw.post_processor = None  # a tokenizer.json that does not add BOS on its own
    for name in ("config.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((model_dir / name).read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": False}))
    raw.save(str(tmp_path / "tokenizer.json"))
    assert raw.encode("alpha beta").ids[0] != 0

    tokenizer = load_tokenizer(make_config(tmp_path, data_parallel_size=2))
    encoded = tokenizer.encode("alpha beta")
    assert encoded.ids[0] == raw.token_to_id(BOS) == 0
    assert encoded.ids[1:] == raw.encode("alpha beta").ids
    assert tokenizer.encode("alpha beta", add_special_tokens=False).ids == raw.encode("alpha beta").ids
    assert tokenizer.encode("").ids == [0], "DeepInfer's policy asserts encode('') == [BOS]"


class _Engine:
    closed = 0

    def __init__(self) -> None:
        self.tokenizer = object()  # no fast backend: the binding refuses it after construction

    def close(self) -> None:
        type(self).closed += 1


class _LLMEngine:
    @staticmethod
    def from_engine_args(args: Any) -> _Engine:
        return _Engine()


@pytest.mark.parametrize(("ranks", "closes"), [(1, 1), (2, 0)])
def test_failure_after_construction_closes_only_a_single_rank_engine(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, ranks: int, closes: int
) -> None:
    """``close()`` is a collective with DP > 1: a rank that fails alone must not enter it (its peers never would);
    its process exits instead and the dispatcher restarts the group."""
    envs = SimpleNamespace(DEEPINFER_BATCH_INVARIANT=0, DEEPINFER_USE_NEXTN_DECODE=0)
    modules = startup.DeepInferModules("0.1.0", envs, lambda **fields: fields, _LLMEngine, object())
    monkeypatch.setattr(startup, "import_deepinfer", lambda: modules)
    monkeypatch.setattr(startup, "check_accelerator", lambda config: None)
    monkeypatch.setattr(startup, "apply_environment", lambda env: None)
    _Engine.closed = 0
    config = make_config(model_dir, data_parallel_size=ranks, visible_devices=",".join(map(str, range(ranks))))
    with pytest.raises(startup.DeepInferStartupError, match="fast backend"):
        startup.start_engine(config)
    assert _Engine.closed == closes
