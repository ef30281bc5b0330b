"""The reference engine's optional timing model: a step lasts as long as it would on the imitated deployment."""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Seconds per prefill token and per decode step (zero: the engine runs as fast as the CPU allows)."""

    prefill_seconds_per_token: float = 0.0
    decode_seconds_per_step: float = 0.0

    def pace(self, started: float, prefill_tokens: int, decoded: bool) -> None:
        """Sleep out the rest of a step begun at ``started`` (``time.perf_counter``) that prefilled and decoded so."""
        delay = self.prefill_seconds_per_token * prefill_tokens
        if decoded:
            delay += self.decode_seconds_per_step
        if delay > 0.0:
            remaining = delay - (time.perf_counter() - started)
            if remaining > 0.0:
                time.sleep(remaining)
