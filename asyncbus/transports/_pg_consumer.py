"""The consuming side of :class:`~asyncbus.transports.postgres.PostgresTransport`: a
subscription claims rows of its group, hands them out as deliveries, and gives back what
it still holds when it ends.

A claim is one ``UPDATE ... FOR UPDATE SKIP LOCKED`` of at most as many rows as the
subscription has room for (its prefetch less what it holds), oldest first among those
available (not delayed, and unclaimed or claimed past their deadline). With nothing to
claim it waits for a wake-up (the transport's ``LISTEN``: a publish, a release) or its
poll, whichever comes first; a delayed nack of its own wakes it when due.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import DecodeError, TransportError
from ._codec import RawBody, dead_letter_to_wire, envelope_from_wire
from ._kit.delivery import BaseDelivery
from ._kit.options import checked_prefetch
from ._kit.plain import plain_envelope
from ._kit.redeliveries import over_max_deliveries

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["PgDelivery", "PgSubscription"]

logger = logging.getLogger("asyncbus.postgres")

#: The longest delay a nack is given (seconds: about 31 years; an infinite one too).
_LONGEST = 1e9

#: Why a delivery can no longer be settled once its subscription gave it back.
_RELEASED = "was released when its subscription ended"
_GIVEN_BACK = "was given back when its subscription's prefetch came down"


class PgDelivery(BaseDelivery):
    """A claimed row of the messages table, settled by deleting or updating that row."""

    __slots__ = ("_queued_at", "_subscription", "seq")

    acks_behind = True

    def __init__(
        self,
        subscription: PgSubscription,
        seq: int,
        envelope: Envelope,
        error: str | None,
        queued_at: float,
    ) -> None:
        super().__init__(envelope, error)
        self._subscription = subscription
        self.seq = seq
        self._queued_at = queued_at

    def queued_at(self) -> float | None:
        """When the row was written (the database's clock)."""
        return self._queued_at

    def _settled(self) -> None:
        subscription = self._subscription
        if subscription.held.pop(self.seq, None) is not None:
            subscription.wake.set()  # room for one more

    def _queue_ack(self) -> None:
        """Queue the row's deletion for the transport's ack writer (in batches)."""
        subscription = self._subscription
        subscription.transport.acks.queue(
            subscription.group_id,
            subscription.stage,
            self.seq,
            self.envelope.id,
            subscription.prefetch,
        )

    async def _nack(self, delay: float | None) -> None:
        """Unclaim the row for its next attempt, available after ``delay`` seconds."""
        subscription = self._subscription
        transport = subscription.transport
        wait = 0.0 if delay is None or math.isnan(delay) or delay < 0 else min(delay, _LONGEST)
        await transport.run(
            "nacking", "execute", transport.sql.nack, self.seq, wait, subscription.consumer
        )
        if wait > 0:
            subscription.due_soon(anyio.current_time() + wait)

    async def _reject(self, entry: DeadLetter) -> None:
        """Store the dead letter and delete the row, in one statement."""
        transport = self._subscription.transport
        stored = dead_letter_to_wire(entry, transport.codec)
        await transport.run(
            "rejecting",
            "execute",
            transport.sql.reject,
            self.seq,
            entry.envelope.id,
            entry.dead_at,
            stored,
            self._subscription.consumer,
        )


class PgSubscription:
    """One consumer of a group: iterate it for deliveries (see the module's docstring).

    :ivar held: deliveries received and not settled, by row.
    :ivar wake: set when there may be something to claim (a notification, a settle).
    """

    def __init__(
        self,
        transport: PgHost,
        group_id: int,
        pattern: str,
        group: str,
        prefetch: int,
        consumer: str,
    ) -> None:
        self.transport = transport
        self.group_id = group_id
        self.pattern = pattern
        self.group = group
        self.prefetch = prefetch
        self.consumer = consumer
        #: The stage name, ``pattern@group``.
        self.stage = f"{pattern}@{group}"
        self.held: dict[int, PgDelivery] = {}
        self.ready: deque[PgDelivery] = deque()
        self.wake = anyio.Event()
        #: Whether the transport renews its claims while they are held.
        self.keep_alive = transport.keep_alive
        #: When rows this one delayed come due (anyio clock), soonest first: each is
        #: looked for at its own time, not only the soonest one.
        self._due: list[float] = []

    def __aiter__(self) -> PgSubscription:
        return self

    def due_soon(self, when: float) -> None:
        """Look for work again at ``when`` (anyio clock): a row this one delayed."""
        heapq.heappush(self._due, when)

    async def __anext__(self) -> PgDelivery:
        while not self.ready:
            self.wake = anyio.Event()  # before the claim: a wake-up meanwhile is kept
            room = self.prefetch - len(self.held)
            if room > 0 and await self._claim(room):
                break
            now = anyio.current_time()
            due = self._due
            if due and due[0] <= now:
                while due and due[0] <= now:
                    heapq.heappop(due)
                continue
            wait = self.transport.poll_interval
            if due:
                wait = min(wait, due[0] - now)
            with anyio.move_on_after(wait):
                await self.wake.wait()
        return self.ready.popleft()

    async def _claim(self, room: int) -> bool:
        transport = self.transport
        # Shielded (bounded): a claim cancelled in flight may still commit, and rows
        # claimed but never recorded would wait out ack_timeout instead of being given
        # back when the subscription ends.
        rows: list[Any] = []
        failed: TransportError | None = None
        with transport.cleanup_scope(transport.publish_timeout + 1.0) as scope:
            try:
                rows = await transport.run(
                    "claiming",
                    "fetch",
                    transport.sql.claim,
                    self.group_id,
                    self.consumer,
                    transport.ack_timeout,
                    room,
                )
            except TransportError as error:
                failed = error
            for row in sorted(rows, key=lambda row: row[0]):
                self._take(*row)
        # A cancellation that came meanwhile (the bus stopping) wins over the failure.
        await anyio.lowlevel.checkpoint_if_cancelled()
        if failed is not None:
            raise failed
        if scope.cancelled_caught:  # the close's deadline cut it short
            raise TransportError("PostgreSQL: claiming was cut short by the transport's close")
        return bool(rows)

    def _take(
        self, seq: int, meta: bytes, body: bytes, attempt: int, deliveries: int, queued: float
    ) -> None:
        error: str | None
        try:
            if meta:
                envelope, error = envelope_from_wire(
                    meta, body, self.transport.codec, attempt=attempt + deliveries - 1
                )
            else:  # a plain row: another client's, its body alone
                envelope, error = plain_envelope(
                    body,
                    self.transport.codec,
                    envelope_id=f"postgres:{self.group_id}:{seq}",
                    topic=self.pattern,
                    attempt=attempt + deliveries - 1,
                    timestamp=queued,
                )
        except DecodeError as problem:
            envelope = Envelope(
                id=f"postgres:{self.group_id}:{seq}",
                topic=self.pattern,
                payload=RawBody(body),
                attempt=max(1, attempt + deliveries - 1),
            )
            error = str(problem)
        if error is None and deliveries > 1:
            error = over_max_deliveries(deliveries, self.transport.max_deliveries)
        delivery = PgDelivery(self, seq, envelope, error, queued)
        delivery.redeliveries = deliveries - 1
        self.held[seq] = delivery
        self.ready.append(delivery)

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` from now on: what was received and not handed out
        beyond that is given back at once, uncounted (the newest first)."""
        self.prefetch = checked_prefetch(prefetch)
        beyond: list[PgDelivery] = []
        while len(self.held) - len(beyond) > self.prefetch and self.ready:
            beyond.append(self.ready.pop())
        for delivery in beyond:
            del self.held[delivery.seq]
            delivery.take_back(_GIVEN_BACK)
        await self._give_back([delivery.seq for delivery in beyond])
        self.wake.set()

    async def flush(self) -> None:
        """Return once every ack queued by this subscription's deliveries is written."""
        await self.transport.acks.flush([self.group_id])

    async def release(self) -> None:
        """Give back every row held (handed out or not), uncounted, and wake the group's
        other consumers; a row another consumer claimed meanwhile is left to it."""
        held, self.held = self.held, {}
        self.ready.clear()
        for delivery in held.values():
            delivery.take_back(_RELEASED)
        await self._give_back(list(held))

    async def _give_back(self, rows: list[int]) -> None:
        """Unclaim ``rows``; a database that cannot be told leaves them to come back
        after ``ack_timeout`` (logged, not raised: this runs as a subscription ends)."""
        if not rows:
            return
        transport = self.transport
        with transport.cleanup_scope(transport.close_timeout):
            try:
                await transport.run(
                    "giving back",
                    "execute",
                    transport.sql.release,
                    rows,
                    self.consumer,
                    self.group_id,
                )
            except TransportError as error:
                logger.warning("%s (they come back after ack_timeout)", error)
