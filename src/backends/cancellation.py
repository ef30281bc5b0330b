"""Cancelling a task on behalf of a cause, and telling later whether a ``CancelledError`` was that cause's.

Several things may cancel the task that serves a request: the client going away, a deadline passing, the server
shutting down. Each cause that cancels a task must, when the ``CancelledError`` arrives, recognise its own and
withdraw it (``Task.uncancel``) so the task goes on to answer (499, a timeout error), while a cancellation it did
not send (shutdown) keeps propagating. :class:`TaskCancel` is that bookkeeping, written once for every cause.
"""

from __future__ import annotations

import asyncio


class TaskCancel:
    """Cancels ``task`` at most once for one cause, and claims the ``CancelledError`` that results."""

    __slots__ = ("_before", "sent", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self._before = 0
        self.sent = False
        """Whether this cause cancelled the task and the cancellation was not claimed yet."""

    def cancel(self) -> None:
        """Cancels the task for this cause (again only after the previous one was claimed)."""
        if not self.sent:
            self.sent = True
            self._before = self.task.cancelling()
            self.task.cancel()

    def claim(self, exc: BaseException) -> bool:
        """Whether ``exc`` is this cause's cancellation and no other cause cancelled the task meanwhile; this
        cause's cancellation is withdrawn from the task either way, so only the others' go on."""
        if not (self.sent and isinstance(exc, asyncio.CancelledError)):
            return False
        self.sent = False
        return self.task.uncancel() <= self._before
