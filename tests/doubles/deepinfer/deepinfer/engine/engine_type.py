"""TEST DOUBLE of ``deepinfer.engine.engine_type``."""

from __future__ import annotations

import enum


class EngineType(enum.Enum):
    NORMAL = 0
    PROMPT = 1
    COMPLETION = 2

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        return self is not EngineType.PROMPT
