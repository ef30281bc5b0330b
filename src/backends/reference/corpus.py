"""Training text for the reference engine: docstrings of the Python standard library on this machine.

The rule for the language model's data is that it is the project's own or already on the machine, and is read at
build time; nothing is downloaded. The standard library ships with every Python, so its docstrings give a few MB
of real English prose with no network and no data files in the repository.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path

MAX_CORPUS_CHARS = 4_000_000
"""Cap on the paragraph text read; the 3.11 standard library has about 1.8 MB of docstrings."""

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
"""Third-party packages differ per machine, and test suites are mostly fixtures rather than prose."""

_MIN_PARAGRAPH_CHARS = 24
_MAX_PARAGRAPH_CHARS = 2000
_WHITESPACE = re.compile(r"\s+")
_BLANK_LINE = re.compile(r"\n\s*\n")
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_root() -> Path:
    """The directory of this interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Every standard-library ``.py`` file outside tests and site-packages, in sorted (deterministic) order."""
    base = root if root is not None else stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found.extend(Path(dirpath, name) for name in filenames if name.endswith(".py"))
    return sorted(found)


def sources_digest(paths: Iterable[Path], root: Path | None = None) -> str:
    """A content hash of the source files, cheap enough (~0.1 s) to key the build cache on every start."""
    base = root if root is not None else stdlib_root()
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(base)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def _docstrings(source: bytes) -> Iterator[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a stdlib file written for another version; skip it
        return
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED):
            text = ast.get_docstring(node, clean=True)
            if text:
                yield text


def _is_prose(paragraph: str) -> bool:
    """Drop doctest sessions, code blocks and tables; keep sentences."""
    if ">>>" in paragraph or paragraph.startswith(("    ", "\t")):
        return False
    letters = sum(ch.isalpha() for ch in paragraph)
    return letters >= 0.6 * len(paragraph) and paragraph.count(" ") >= 2


def split_paragraphs(docstring: str) -> Iterator[str]:
    """Blank-line separated blocks of prose, each folded onto one line."""
    for block in _BLANK_LINE.split(docstring):
        if not _is_prose(block):
            continue
        paragraph = _WHITESPACE.sub(" ", block).strip()
        if _MIN_PARAGRAPH_CHARS <= len(paragraph) <= _MAX_PARAGRAPH_CHARS:
            yield paragraph


def docstring_paragraphs(paths: Iterable[Path], max_chars: int = MAX_CORPUS_CHARS) -> list[str]:
    """Unique prose paragraphs from the files' docstrings, in file order, up to ``max_chars`` characters."""
    seen: set[str] = set()
    paragraphs: list[str] = []
    total = 0
    for path in paths:
        for docstring in _docstrings(path.read_bytes()):
            for paragraph in split_paragraphs(docstring):
                if paragraph in seen:
                    continue
                seen.add(paragraph)
                paragraphs.append(paragraph)
                total += len(paragraph)
                if total >= max_chars:
                    return paragraphs
    return paragraphs
