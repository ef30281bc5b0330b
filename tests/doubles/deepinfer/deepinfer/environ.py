"""TEST DOUBLE of ``deepinfer.environ``: ``DEEPINFER_*`` variables read on first access, then cached."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _bool(value: str | None, default: str = "0") -> bool:
    return (value if value is not None else default) not in ("0", "", "false", "False")


class _EnvVar:
    """Resolved from ``os.environ`` on first access and cached on the class, like DeepInfer's ``EnvVar``."""

    def __init__(self, parse: Callable[[str | None], Any]) -> None:
        self.parse = parse
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type) -> Any:
        cached = owner.__dict__.get("_cache", {})
        if self.name not in cached:
            cached[self.name] = self.parse(os.environ.get(self.name))
        return cached[self.name]


def _int(default: int) -> _EnvVar:
    return _EnvVar(lambda v: int(v) if v is not None else default)


def _flag(default: bool = False) -> _EnvVar:
    return _EnvVar(lambda v: _bool(v, "1" if default else "0"))


def _choice(default: str, choices: tuple[str, ...]) -> _EnvVar:
    def parse(value: str | None) -> str:
        if value is None:
            return default
        if value not in choices:
            raise ValueError(f"{value!r}, must be one of {choices}")
        return value

    return _EnvVar(parse)


class envs:
    """The variables the double honours; the real module defines many more."""

    _cache: dict[str, Any] = {}  # noqa: RUF012

    DEEPINFER_ACCELERATOR = _EnvVar(lambda v: v if v is not None else "nvidia")
    DEEPINFER_USE_NEXTN_DECODE = _int(5)
    DEEPINFER_ENABLE_MTP_VARLEN = _flag()
    DEEPINFER_BATCH_INVARIANT = _flag()
    DEEPINFER_ZERO_OVERHEAD_SCHEDULING = _flag()
    DEEPINFER_USE_MULTIMODAL_POOL = _flag()
    DEEPINFER_PREFILL_ATTEMPT_INTERVAL = _int(70)
    DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL = _int(100)
    DEEPINFER_SO_BUILDER_CPUS = _int(4)
    DEEPINFER_XGRAMMAR_TIMEOUT = _int(20)
    DEEPINFER_LOGGING_INTERVAL_STEP = _int(100)
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE = _choice("off", ("off", "mask", "compact"))
    DEEPINFER_YOCO_PREFILL_KEEP_TOKENS = _int(0)


def rearm(name: str) -> None:
    """Forget a cached value so the next access reads the environment again."""
    envs._cache.pop(name, None)
