"""Stop strings, which DeepInfer's engine does not have: matched on the detokenized text."""

from __future__ import annotations


class StopMatcher:
    """Finds the first stop string in a stream of text deltas.

    Text that might be the start of a stop string is held back until the next delta decides, so the
    client never sees any part of the stop text.
    """

    __slots__ = ("_held", "_stops", "matched")

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None
        """The stop string that matched, once one did."""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched). After a match, stop feeding."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # The stream stops where a stop string is first completed (earliest end, then earliest start), which
        # gives the same answer however the text was split into deltas.
        first, first_end = -1, -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1:
                end = at + len(stop)
                if first == -1 or end < first_end or (end == first_end and at < first):
                    first, first_end = at, end
                    self.matched = stop
        if first != -1:
            self._held = ""
            return buf[:first], True
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), hold, -1):
                if buf.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return (buf[: len(buf) - hold] if hold else buf), False

    def flush(self) -> str:
        """The held-back text, once the sequence ended without a match."""
        held, self._held = self._held, ""
        return held
