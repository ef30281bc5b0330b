"""Finds the model directory DeepInfer loads: a local path, or a repo id already in the Hugging Face cache.

DeepInfer opens ``<model>/config.json`` and the tokenizer files as local paths and never downloads; neither does
the gateway at serve time. ``huggingface_hub`` (installed with ``tokenizers``) is used for the cache lookup when
present; otherwise the cache layout (``models--org--name/refs``, ``snapshots``) is read directly.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither a usable local directory nor a complete snapshot in the HF cache."""


def hf_hub_cache() -> Path:
    """The Hugging Face hub cache directory, from the same variables ``huggingface_hub`` reads."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = Path(os.environ["XDG_CACHE_HOME"]).expanduser() if os.environ.get("XDG_CACHE_HOME") else None
    return (base or Path.home() / ".cache") / "huggingface" / "hub"


def resolve_model_dir(model: str, revision: str | None = None, *, what: str = "model") -> Path:
    """Returns the directory to pass to DeepInfer, or raises ``ModelNotFoundError`` saying what is missing."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _checked(path.resolve(), what, model)
    if path.is_absolute() or model.startswith((".", "~")) or not _REPO_ID.fullmatch(model):
        raise ModelNotFoundError(f"{what} directory {model!r} does not exist")
    cache = hf_hub_cache()
    snapshot = _snapshot_with_hub(model, revision, cache)
    if snapshot is None:
        snapshot = _snapshot_in_cache(model, revision or "main", cache)
    if snapshot is None:
        raise ModelNotFoundError(
            f"{what} {model!r} is not a local directory and revision {revision or 'main'!r} is not in the Hugging "
            f"Face cache at {cache}; the gateway never downloads at serve time: run "
            f"`huggingface-cli download {model}` first, or give a local directory"
        )
    return _checked(snapshot, what, model)


def _checked(directory: Path, what: str, model: str) -> Path:
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise ModelNotFoundError(f"{what} {model!r} ({directory}) lacks {', '.join(missing)}")
    return directory


def _snapshot_with_hub(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """Asks ``huggingface_hub``'s offline cache lookup, if the library is installed (it never downloads)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache, revision=revision)
    except Exception as exc:  # a malformed cache or id: fall back to reading the layout ourselves
        logger.warning("huggingface_hub could not look %s up in %s: %s", repo_id, cache, exc)
        return None
    return Path(found).parent if isinstance(found, str) else None


def _snapshot_in_cache(repo_id: str, revision: str, cache: Path) -> Path | None:
    """Reads the hub cache layout: ``models--org--name/refs/<revision>`` names a ``snapshots/<commit>``."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if _COMMIT.fullmatch(revision) else None
    if commit is None:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None
