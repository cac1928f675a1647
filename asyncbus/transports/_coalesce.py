"""Group commit: publishes that arrive while a write is in flight go together in the next one.

A broker round trip costs far more than the bytes of one small envelope, and a busy
service has many publishes waiting on it at once. :class:`Coalescer` lets each of them
hand its item over and wait; one writer task takes everything handed over since its
last write and writes it in one go (one Redis pipeline, say). Nobody waits for a
timer: a lone publish is written at once, and under load the batch grows by itself to
the number of publishers waiting. Each caller returns only after the write holding its
item succeeded, so a publish still means "the broker has it".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

from .._exceptions import TransportError

__all__ = ["Coalescer"]

T = TypeVar("T")


class _Batch(Generic[T]):
    __slots__ = ("done", "error", "items")

    def __init__(self) -> None:
        self.items: list[T] = []
        self.done = anyio.Event()
        self.error: BaseException | None = None


class Coalescer(Generic[T]):
    """Gathers items from many tasks and writes them in batches from one task.

    :param write: writes one batch (in submission order); raising fails every item
        of that batch.
    """

    def __init__(self, write: Callable[[list[T]], Awaitable[None]]) -> None:
        self._write = write
        self._open: _Batch[T] | None = None  # taking items, not written yet
        self._closed: str | None = None
        self._wake = anyio.Event()

    async def submit(self, item: T) -> BaseException | None:
        """Queue ``item`` for the next write and wait for it.

        :returns: ``None`` once the write holding ``item`` succeeded, else what that
            write raised (the caller words the error: it knows what it published).
        """
        if self._closed is not None:
            return TransportError(self._closed)
        batch = self._open
        if batch is None:
            batch = self._open = _Batch()
            self._wake.set()
        batch.items.append(item)
        await batch.done.wait()
        return batch.error

    async def run(self) -> None:
        """The writer loop; run it as a task until it is cancelled (then :meth:`close`)."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._open = self._open, None
            if batch is None:
                continue
            written = False
            try:
                await self._write(batch.items)
                written = True
            except Exception as error:
                batch.error = error
                written = True
            finally:
                if not written:
                    # Cancelled in the middle of the write: its outcome is unknown.
                    batch.error = TransportError(
                        "the transport closed while writing: the envelopes may or may not "
                        "have been written"
                    )
                batch.done.set()

    def close(self, reason: str) -> None:
        """Fail what waits for a write that will not come, and refuse new items."""
        self._closed = reason
        batch, self._open = self._open, None
        if batch is not None:
            batch.error = TransportError(reason)
            batch.done.set()
