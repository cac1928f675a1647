"""Group commit: publishes that arrive while a write is in flight go together in the next one.

A broker round trip costs far more than the bytes of one small envelope, and a busy
service has many publishes waiting on it at once. :class:`Coalescer` lets each of them
hand its item over and wait; one writer task takes the oldest batch handed over since
its last write and writes it in one go (one Redis script call, say). Nobody waits for
a timer: a lone publish is written at once, and under load a batch grows by itself to
the number of publishers waiting, up to a bound in items and bytes (the next items
start the next batch). Each caller returns only after the write holding its item
succeeded, so a publish still means "the broker has it".

A ``timeout`` bounds the wait of every caller without a timer per caller (a cancel
scope with a deadline per publish cost more than the rest of a publish): each batch
takes its deadline when it opens, its first item's, and the writer bounds the write
of a batch by what is left of it (a batch whose deadline passed while it waited is
failed unwritten). Batches are written oldest first, so the write a batch waits
behind ends by an earlier deadline.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
import anyio.lowlevel

from .._exceptions import TransportError

__all__ = ["Coalescer"]

T = TypeVar("T")

#: Why the items of a write that was cancelled midway failed.
_UNKNOWN = "the transport closed while writing: the envelopes may or may not have been written"


class _Batch(Generic[T]):
    __slots__ = ("deadline", "done", "error", "items", "size")

    def __init__(self, deadline: float) -> None:
        self.items: list[T] = []
        self.size = 0
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self.deadline = deadline


class Coalescer(Generic[T]):
    """Gathers items from many tasks and writes them in batches from one task.

    :param write: writes one batch (in submission order); raising fails every item
        of that batch.
    :param max_items: most items in one batch.
    :param max_size: most bytes (as the callers count them) in one batch; an item
        larger than that goes alone.
    :param timeout: longest (seconds) a caller waits, queued behind other writes
        included; past it the caller gets a :class:`TimeoutError` (its item may or may
        not be written). ``None``: no bound.
    """

    def __init__(
        self,
        write: Callable[[list[T]], Awaitable[None]],
        *,
        max_items: int = 1000,
        max_size: int = 16 * 1024 * 1024,
        timeout: float | None = None,
    ) -> None:
        self._write = write
        self._timeout = timeout
        self._max_items = max_items
        self._max_size = max_size
        #: Batches taking items or waiting for the writer, oldest first.
        self._waiting: deque[_Batch[T]] = deque()
        self._closed: str | None = None
        self._wake = anyio.Event()

    async def submit(self, item: T, size: int = 0) -> BaseException | None:
        """Queue ``item`` (``size`` bytes) for a write and wait for that write.

        A caller cancelled before the writer took its batch takes its item back; once
        the write began, the item may or may not be written.

        :returns: ``None`` once the write holding ``item`` succeeded, else what that
            write raised, or a :class:`TimeoutError` past the timeout (the caller words
            the error: it knows what it published).
        """
        if self._closed is not None:
            return TransportError(self._closed)
        batch = self._waiting[-1] if self._waiting else None
        if batch is None or (
            batch.items
            and (len(batch.items) >= self._max_items or batch.size + size > self._max_size)
        ):
            timeout = self._timeout
            batch = _Batch(math.inf if timeout is None else anyio.current_time() + timeout)
            self._waiting.append(batch)
            self._wake.set()
        batch.items.append(item)
        batch.size += size
        try:
            await batch.done.wait()
        except BaseException:  # deliberate: a caller that gives up takes its item back
            if batch in self._waiting:  # not taken by the writer yet: take the item back
                for index, queued in enumerate(batch.items):
                    if queued is item:
                        del batch.items[index]
                        batch.size -= size
                        break
            raise
        return batch.error

    async def run(self) -> None:
        """The writer loop; run it as a task. However it ends, the coalescer closes."""
        try:
            while True:
                while not self._waiting:
                    wake = self._wake = anyio.Event()
                    await wake.wait()
                await self._write_one(self._waiting.popleft())
                # Let the callers this write woke up run first: they fill the next batch
                # before it is taken (without this yield, batches shrink to what came in
                # during the write, and round trips multiply).
                await anyio.lowlevel.checkpoint()
        finally:
            self.close("the transport's writer stopped: nothing more can be published")

    async def _write_one(self, batch: _Batch[T]) -> None:
        if not batch.items:  # every caller took its item back
            batch.done.set()
            return
        written = False
        try:
            if batch.deadline == math.inf:
                await self._write(batch.items)
            else:
                left = batch.deadline - anyio.current_time()
                if left <= 0:
                    raise TimeoutError("the batch's deadline passed before its write began")
                with anyio.fail_after(left):
                    await self._write(batch.items)
            written = True
        except Exception as error:
            batch.error = error
            written = True
        finally:
            if not written:
                batch.error = TransportError(_UNKNOWN)  # cancelled in the middle of the write
            batch.done.set()

    def close(self, reason: str) -> None:
        """Fail what waits for a write that will not come, and refuse new items."""
        if self._closed is None:
            self._closed = reason
        while self._waiting:
            batch = self._waiting.popleft()
            batch.error = TransportError(self._closed)
            batch.done.set()
