"""The pause between two attempts of something retried (a read, a reconnection...)."""

from __future__ import annotations

import random

import anyio

__all__ = ["Backoff"]


class Backoff:
    """Exponential pauses: ``first``, doubling after each, never over ``most``.

    :param first: the first pause (seconds), and the one after :meth:`reset`.
    :param most: the longest pause.
    :param jitter: draw each pause from its upper half (between ``pause / 2`` and
        ``pause``), so processes that failed together do not retry together.
    """

    __slots__ = ("_next", "first", "jitter", "most")

    def __init__(self, first: float = 0.05, most: float = 2.0, *, jitter: bool = False) -> None:
        self.first = first
        self.most = most
        self.jitter = jitter
        self._next = first

    def next(self) -> float:
        """The pause to take now (the following one is twice as long, up to ``most``)."""
        pause = self._next
        self._next = min(pause * 2, self.most)
        return pause * (0.5 + random.random() / 2) if self.jitter else pause

    def reset(self) -> None:
        """It worked: the next failure pauses ``first`` again."""
        self._next = self.first

    async def sleep(self) -> float:
        """Sleep :meth:`next` seconds; return how long."""
        pause = self.next()
        await anyio.sleep(pause)
        return pause
