"""The reference engine's tokenizer: DeepSeek's marker layout, so grammars and parsers see real token splits."""

from __future__ import annotations

import pytest

from backends.reference import ReferenceArtifacts, load_or_build


@pytest.fixture(scope="session")
def artifacts() -> ReferenceArtifacts:
    return load_or_build()
