"""The tokenizer and model are built once and then loaded from a keyed, atomically published cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from backends.reference import ReferenceArtifacts, load_or_build
from backends.reference import artifacts as artifacts_module
from backends.reference.corpus import split_paragraphs


def test_second_load_uses_the_cache_instead_of_rebuilding(
    artifacts: ReferenceArtifacts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[int] = []

    def fake_build(vocab_size: int = 8000) -> tuple:
        builds.append(vocab_size)  # reuse the session's real result: a full build takes seconds
        return artifacts.tokenizer, artifacts.model

    monkeypatch.setattr(artifacts_module, "build", fake_build)
    first = load_or_build(tmp_path)
    second = load_or_build(tmp_path)
    assert builds == [8000]
    assert first.built and not second.built and first.path == second.path
    assert second.tokenizer.to_str() == artifacts.tokenizer.to_str()
    assert np.array_equal(second.model.trigram_ids, artifacts.model.trigram_ids)
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # no staging leftovers


def test_cache_dir_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_GATEWAY_CACHE", str(tmp_path))
    assert artifacts_module.default_cache_dir() == tmp_path


def test_cache_key_changes_with_vocab_size_and_corpus() -> None:
    key = artifacts_module.cache_key("digest", 8000)
    assert key == artifacts_module.cache_key("digest", 8000)
    assert key != artifacts_module.cache_key("digest", 4000)
    assert key != artifacts_module.cache_key("other", 8000)


def test_a_lost_publishing_race_keeps_the_winners_files(artifacts: ReferenceArtifacts, tmp_path: Path) -> None:
    path = tmp_path / "entry"
    artifacts_module._publish(path, artifacts.tokenizer, artifacts.model, "d", 8000)
    winner = (path / "model.npz").stat().st_mtime_ns
    artifacts_module._publish(path, artifacts.tokenizer, artifacts.model, "d", 8000)
    assert (path / "model.npz").stat().st_mtime_ns == winner
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_corpus_keeps_prose_and_drops_doctests() -> None:
    doc = "Return the thing.\n\nMore words about\nthe thing here.\n\n>>> thing()\n1\n\n    code block here"
    assert list(split_paragraphs(doc)) == ["More words about the thing here."]
