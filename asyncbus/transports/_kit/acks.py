"""Acks written behind: a delivery's ``ack_nowait`` queues, one task writes in batches.

Awaiting a broker round trip for every ack (shielded, since an ack must not be lost
to a cancellation) costs more than the rest of handling a small envelope. A
transport whose deliveries offer ``ack_nowait`` queues each ack here under a key
(what one write addresses: a stream and group, a channel) and returns at once; the
writer task lingers a moment so that a busy consumer's acks go together, then hands
everything queued to the transport's ``write``. A key can set a batch size: once that
many of its acks wait, the writer stops lingering (a broker that holds back deliveries
until earlier ones are acked, RabbitMQ's prefetch, is never kept waiting for the
linger, and a busy consumer writes one ack for many deliveries). What a write did not
take is kept (and written again: acks are idempotent) or, when the transport says the
broker will deliver those envelopes again anyway, reported as lost. A transport closing
writes what is queued first, within its clean-up deadline; what is still queued after
that is lost too. The bus reports every lost ack (``unsettled_acks``) as abandoned in
its ``ShutdownReport``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Hashable
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

import anyio

from ..._exceptions import TransportError
from .backoff import Backoff

__all__ = ["AckWriter"]

logger = logging.getLogger("asyncbus.transport")

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

#: Acks by key: what the broker needs (an entry id, a delivery tag) and the envelope id
#: (``None``: an ack the bus did not ask for, e.g. of a delivery re-sent for a retry,
#: whose loss is not reported).
Acks = dict[K, list[tuple[T, str | None]]]


class AckWriter(Generic[K, T]):
    """Acks queued from deliveries and written behind by one task (see the module).

    :param owner: the transport's name, for logs and errors.
    :param write: writes one batch (key -> the acks queued under it, oldest first);
        returns the keys whose acks are lost for good (the broker delivers those
        envelopes again, e.g. their channel is gone). Raising means nothing was
        written: the batch is queued again and retried after a pause.
    :param cleanup_scope: the transport's :meth:`~asyncbus.transports.Transport.cleanup_scope`:
        every write runs shielded, bounded by it.
    :param linger: seconds the writer waits for more acks before writing.
    :param timeout: longest one write may take.
    """

    def __init__(
        self,
        owner: str,
        write: Callable[[Acks[K, T]], Awaitable[Collection[K]]],
        cleanup_scope: Callable[[float], AbstractContextManager[anyio.CancelScope]],
        *,
        linger: float = 0.002,
        timeout: float = 5.0,
    ) -> None:
        self._owner = owner
        self._write = write
        self._cleanup_scope = cleanup_scope
        self._linger = linger
        self._timeout = timeout
        self._pending: Acks[K, T] = {}
        #: The stage name of each key acks were queued under.
        self._stages: dict[K, str] = {}
        self._lost: list[tuple[str, str]] = []
        self._open = False
        # Made in ``open``, inside the event loop that uses them.
        self._wake: anyio.Event
        #: Set when a key holds its batch of acks: the writer stops lingering.
        self._full: anyio.Event
        self._lock: anyio.Lock

    def open(self) -> None:
        """Accept acks (called when the transport connects, before :meth:`run` starts)."""
        self._wake = anyio.Event()
        self._full = anyio.Event()
        self._lock = anyio.Lock()
        self._open = True

    def queue(self, key: K, stage: str, item: T, envelope_id: str | None, batch: int = 0) -> None:
        """Queue one ack of ``stage`` under ``key``; the writer writes it within ``linger``.

        :param batch: once this many acks wait under ``key``, the writer writes at once
            instead of lingering (``0``: it always lingers).
        :raises TransportError: when the transport is not connected (or closed).
        """
        if not self._open:
            raise TransportError(f"{self._owner} is closed: the ack cannot be written")
        queued = self._pending.get(key)
        if queued is None:
            queued = self._pending[key] = []
            self._stages[key] = stage
        queued.append((item, envelope_id))
        if not self._wake.is_set():
            self._wake.set()
        if batch and len(queued) >= batch and not self._full.is_set():
            self._full.set()

    def queued(self, key: K) -> bool:
        """Whether acks wait under ``key``."""
        return key in self._pending

    async def flush(self, keys: Collection[K] | None = None) -> None:
        """Write what is queued now (only under ``keys`` if given), one write at a time.

        :raises Exception: what ``write`` raised (the acks stay queued).
        """
        async with self._lock:
            if keys is None:
                batch, self._pending = self._pending, {}
                # Taken now (the lock may have yielded): what filled a batch goes in
                # this write, so the next one lingers again.
                self._full = anyio.Event()
            else:
                batch = {key: self._pending.pop(key) for key in keys if key in self._pending}
            if not batch:
                return
            try:
                lost = await self._write(batch)
            except BaseException:  # deliberate: cancelled or failed, keep them, re-raise
                for key, items in batch.items():  # idempotent: written again next time
                    self._pending[key] = items + self._pending.get(key, [])
                raise
            for key in lost:
                self._lose(batch.get(key, ()), self._stages.get(key, "?"))
            for key in batch:
                if key not in self._pending:
                    self._stages.pop(key, None)

    async def run(self) -> None:
        """The writer: write acks as they come, in batches (run it in the transport's tasks)."""
        backoff = Backoff()
        while True:
            await self._wake.wait()
            if not self._full.is_set():
                # Linger a moment so that a busy consumer's acks go in one write.
                with anyio.move_on_after(self._linger):
                    await self._full.wait()
            self._wake = anyio.Event()
            try:
                with self._cleanup_scope(self._timeout):
                    await self.flush()
            except Exception as error:
                logger.warning("%s: writing acks failed, retrying: %s", self._owner, error)
                await backoff.sleep()
            else:
                backoff.reset()
            if self._pending:  # failed, or cut short by the clean-up deadline: again
                self._wake.set()

    def close(self) -> None:
        """Accept no more acks; what is still queued is lost (the broker delivers it again)."""
        self._open = False
        pending, self._pending = self._pending, {}
        for key, items in pending.items():
            self._lose(items, self._stages.pop(key, "?"))

    def drop(self, key: K) -> None:
        """Forget ``key``'s acks as lost (its channel went, with its deliveries)."""
        items = self._pending.pop(key, None)
        if items:
            self._lose(items, self._stages.pop(key, "?"))

    def take_lost(self) -> list[tuple[str, str]]:
        """``(stage name, envelope id)`` of each ack lost since the last call (once each)."""
        lost, self._lost = self._lost, []
        return lost

    def _lose(self, items: Collection[tuple[T, str | None]], stage: str) -> None:
        self._lost += [(stage, envelope_id) for _item, envelope_id in items if envelope_id]
