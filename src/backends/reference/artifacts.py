"""Build the reference tokenizer and n-gram model once, then load them from an on-disk cache.

A build takes a few seconds (mostly parsing the standard library); every later start loads the cached files in
well under a second. The cache directory is keyed by everything the result depends on, and it is published
with one ``os.replace`` of a finished temporary directory, so processes building at the same time never see a
half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from . import corpus
from .model import NGramModel, region_table, train
from .tokenizer import (
    DEFAULT_VOCAB_SIZE,
    SpecialTokenIds,
    add_image_token,
    build_tokenizer,
    check_layout,
    special_token_ids,
)

logger = logging.getLogger(__name__)

_BUILDING = threading.Lock()
"""One build at a time in a process: two reference backends starting on a cold cache (each on its engine thread)
would both build, and CPython 3.11's ``ast.parse`` is not safe from two threads at once (the corpus is read with
it; gh-106905: ``SystemError: AST constructor recursion depth mismatch``, seen once in the suite). The second
caller waits and then loads what the first published."""

CACHE_ENV = "DEEPINFER_GATEWAY_CACHE"
_TOKENIZER_FILE = "tokenizer.json"
_MODEL_FILE = "model.npz"
_META_FILE = "meta.json"
_BUILD_MODULES = ("artifacts.py", "corpus.py", "model.py", "tokenizer.py")
"""The build code; its bytes are part of the cache key, so editing it invalidates old caches."""


@dataclass(frozen=True, slots=True)
class ReferenceArtifacts:
    """What the engine needs: the tokenizer, the model, and where they came from."""

    tokenizer: Tokenizer
    model: NGramModel
    special: SpecialTokenIds
    path: Path
    built: bool  # True if this call built the files, False if it loaded them from the cache
    seconds: float


def default_cache_dir() -> Path:
    """``$DEEPINFER_GATEWAY_CACHE`` or ``~/.cache/deepinfer-gateway``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "deepinfer-gateway"


def _build_code_version() -> str:
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _BUILD_MODULES:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def cache_key(corpus_digest: str, vocab_size: int) -> str:
    """Hash of (build code, Python and tokenizers versions, corpus digest, vocab size)."""
    parts = (
        _build_code_version(),
        sys.version,
        tokenizers.__version__,
        corpus_digest,
        str(vocab_size),
    )
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def chat_sequences(paragraphs: Sequence[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """Training sequences shaped like DeepSeek V4.1 chat turns, so the model behaves in chat.

    Chat mode: ``BOS <User> A <Assistant></think> B EOS`` for consecutive paragraphs A, B, so EOS is learned at
    paragraph ends. Thinking mode, for every other pair: ``BOS <User> A <Assistant><think> B </think> C EOS``.
    """
    sp = special_token_ids(tokenizer)
    encoded = [np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(paragraphs, add_special_tokens=False)]
    head = np.array([sp.bos, sp.user], dtype=np.int64)
    chat = np.array([sp.assistant, sp.think_end], dtype=np.int64)
    thinking = np.array([sp.assistant, sp.think], dtype=np.int64)
    close = np.array([sp.think_end], dtype=np.int64)
    eos = np.array([sp.eos], dtype=np.int64)
    sequences: list[np.ndarray] = []
    for i in range(len(encoded) - 2):
        a, b, c = encoded[i], encoded[i + 1], encoded[i + 2]
        sequences.append(np.concatenate([head, a, chat, b, eos]))
        if i % 2 == 0:
            sequences.append(np.concatenate([head, a, thinking, b, close, c, eos]))
    return sequences


def build(vocab_size: int = DEFAULT_VOCAB_SIZE) -> tuple[Tokenizer, NGramModel]:
    """Read the corpus, train the tokenizer, count the n-grams (no cache involved)."""
    paragraphs = corpus.docstring_paragraphs(corpus.stdlib_sources())
    tokenizer = build_tokenizer(paragraphs, vocab_size)
    sp = special_token_ids(tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    regions = region_table(
        vocab,
        prompt=[sp.system, sp.user, sp.latest_reminder],
        reasoning=[sp.think],
        answer=[sp.assistant, sp.think_end],
    )
    return tokenizer, train(chat_sequences(paragraphs, tokenizer), vocab, regions)


def _load(path: Path) -> tuple[Tokenizer, NGramModel]:
    tokenizer = Tokenizer.from_file(str(path / _TOKENIZER_FILE))
    check_layout(tokenizer)
    return tokenizer, NGramModel.load(path / _MODEL_FILE)


def load_or_build(cache_dir: Path | str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE) -> ReferenceArtifacts:
    """Load the artifacts for this machine's corpus from the cache, building and publishing them if absent."""
    with _BUILDING:
        return _load_or_build(cache_dir, vocab_size)


def _load_or_build(cache_dir: Path | str | None, vocab_size: int) -> ReferenceArtifacts:
    started = time.perf_counter()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = corpus.sources_digest(corpus.stdlib_sources())
    path = root / "reference-engine" / f"ngram-{cache_key(digest, vocab_size)}"
    built = False
    if (path / _META_FILE).is_file():
        tokenizer, model = _load(path)
    else:
        tokenizer, model = build(vocab_size)
        built = True
        try:
            _publish(path, tokenizer, model, digest, vocab_size)
        except OSError as exc:  # a read-only or full disk costs the next start a rebuild, nothing more
            logger.warning("reference engine cache not written to %s: %s", path, exc)
    add_image_token(tokenizer)  # not in the cached file: the model is trained without it
    return ReferenceArtifacts(
        tokenizer=tokenizer,
        model=model,
        special=special_token_ids(tokenizer),
        path=path,
        built=built,
        seconds=time.perf_counter() - started,
    )


def _publish(path: Path, tokenizer: Tokenizer, model: NGramModel, digest: str, vocab_size: int) -> None:
    """Write into a temporary sibling directory, then rename it into place; the first finished writer wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared (e.g. baked into an image)
        tokenizer.save(str(staging / _TOKENIZER_FILE))
        model.save(staging / _MODEL_FILE)
        meta = {"corpus_digest": digest, "vocab_size": vocab_size, "python": sys.version}
        (staging / _META_FILE).write_text(json.dumps(meta, indent=2))
        try:
            os.replace(staging, path)
        except OSError:
            if (path / _META_FILE).is_file():  # another process published first; use its copy
                return
            shutil.rmtree(path, ignore_errors=True)  # a damaged cache entry, not a race: replace it
            os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
