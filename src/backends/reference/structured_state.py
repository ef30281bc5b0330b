"""One request's structured-output state: free text until its trigger, the forced rest of it, then the grammar."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

FREE, FORCING, GRAMMAR, DONE = 0, 1, 2, 3
"""Phases of a structured request: before its trigger, forcing the trigger, under the grammar, after EOS."""


def _kmp_failure(pattern: Sequence[int]) -> tuple[int, ...]:
    """KMP failure function: for each prefix, the length of its longest proper border."""
    fail = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = fail[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


class StructuredState:
    """One request's structured-output state: trigger matching, forced tokens, and its grammar matcher."""

    __slots__ = ("bound", "fail", "forced", "matched", "matcher", "phase", "trigger")

    def __init__(self, matcher: llguidance.LLMatcher, trigger: tuple[int, ...], bound: int | None) -> None:
        self.matcher = matcher
        self.trigger = trigger
        self.fail = _kmp_failure(trigger)
        self.bound = bound
        self.matched = 0  # trigger tokens matched so far (KMP state) while FREE; forced so far while FORCING
        self.forced: tuple[int, ...] = ()
        self.phase = FREE if trigger else GRAMMAR

    @property
    def next_forced(self) -> int:
        return self.forced[self.matched]

    def advance(self, token: int, eos: int) -> bool:
        """Account for one emitted token; False if the grammar (or a forced trigger) rejects it."""
        phase = self.phase
        if phase == GRAMMAR:
            if not self.matcher.consume_token(token):
                return False
            if token == eos:
                self.phase = DONE
        elif phase == FREE:
            trigger = self.trigger
            k = self.matched
            while k and trigger[k] != token:
                k = self.fail[k - 1]
            if trigger[k] == token:
                k += 1
            if k == len(trigger):
                self.phase = GRAMMAR
            elif token == self.bound:
                self.forced = trigger[k:]  # the rest of the trigger; all of it unless the bound starts it
                self.matched = 0
                self.phase = FORCING
                return True
            self.matched = k
        elif phase == FORCING:
            if token != self.forced[self.matched]:
                return False
            self.matched += 1
            if self.matched == len(self.forced):
                self.phase = GRAMMAR
        return True
