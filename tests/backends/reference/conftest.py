"""One tokenizer and model per test session, loaded from the user's cache (built there on first use)."""

from __future__ import annotations

import pytest

from backends.reference import ReferenceArtifacts, ReferenceEngine, ReferenceEngineArgs, load_or_build


@pytest.fixture(scope="session")
def artifacts() -> ReferenceArtifacts:
    return load_or_build()


@pytest.fixture
def make_engine(artifacts: ReferenceArtifacts):
    """Engines share the session's artifacts, so creating one costs microseconds."""

    def make(**kwargs: object) -> ReferenceEngine:
        args = ReferenceEngineArgs(**kwargs)  # type: ignore[arg-type]
        return ReferenceEngine(args, artifacts.tokenizer, artifacts.model, artifacts.special)

    return make
