"""A stage: one (pattern, group)'s bounded queue, its door and its ledger.

The stage holds what was admitted and not yet taken by a consumer, decides at the
door what a publish may do (:class:`Backpressure`), re-enters envelopes coming back
from a retry timer, and counts every envelope's end in its :class:`Ledger`. Its
consumers (``_consumer``) take envelopes out and settle them; the bus (through
:class:`StageHost`) records dead letters and wakes ``drain()``.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable, Coroutine
from itertools import repeat, starmap
from typing import Any, Protocol

import anyio

from ._admission import Admission
from ._backpressure import Backpressure
from ._control import StageControl
from ._dead_letters import DeadLetter, DeadLetterReason
from ._door import DoorOutcome, RoomWaiter
from ._envelope import Envelope
from ._exceptions import BusClosedError
from ._flights import FlightLimit
from ._handling import Handling
from ._ledger import Ledger
from ._logging import FailureLog
from ._ordering import KeyGate
from ._partitions import Partitions
from ._stats import LatencyHistogram, StageStatistics
from ._subscription import StageOptions, Subscription
from .transports.base import Delivery

__all__ = [
    "Backpressure",
    "Stage",
    "StageHost",
    "tries_before",
]

_clock = time.perf_counter


class StageHost(Protocol):
    """What a stage needs of the bus that runs it."""

    #: Writes the log records of envelopes that were not acked.
    failure_log: FailureLog

    def dead_letter(
        self,
        envelope: Envelope,
        reason: DeadLetterReason,
        error: str | None,
        stage: str | None,
        attempts: int,
        cause: BaseException | None = None,
        *,
        stored: bool = False,
    ) -> DeadLetter | None:
        """Record ``envelope`` as dead (the dead-letter queue, ``$deadletter``, a requester)."""

    def settled(self, stage: Stage) -> None:
        """An envelope of ``stage`` reached its end (wakes ``drain()`` when it is over)."""

    def start_soon(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``function(*args)`` in the bus's task group."""


class Stage:
    """One subscription group on one pattern: a bounded queue and its ledger.

    Every counter here is touched only from the event-loop thread, and every change
    to the ledger happens without an ``await`` in between, so the ledger's equation
    holds whenever another task can look.
    """

    def __init__(
        self,
        host: StageHost,
        pattern: str,
        group: str,
        capacity: int,
        backpressure: Backpressure,
        *,
        admission: Admission | None = None,
        controlled: bool = False,
        ordered: bool = False,
        stop_key_on_failure: bool = False,
    ) -> None:
        self.host = host
        self.pattern = pattern
        self.group = group
        self.name = f"{pattern}@{group}"
        #: ``(name,)``, shared by every receipt that names only this stage.
        self.names = (self.name,)
        self.capacity = capacity
        self.backpressure = backpressure
        self.subscriptions: list[Subscription] = []
        #: What its group's subscriptions share (its first subscription's), which each
        #: later one must ask for too; ``None`` for a stage made without one.
        self.options: StageOptions | None = None
        self.ledger = Ledger()
        #: Envelopes admitted and not yet taken by a consumer.
        self.queued = 0
        #: Envelopes taken by a consumer (or waiting for a retry) and not yet settled.
        self.in_flight = 0
        self.latency = LatencyHistogram()
        self.wait = LatencyHistogram()
        #: The consumers' handlings: an envelope one holds is unsettled until it is None.
        self.handlings: list[Handling] = []
        #: What each batch consumer holds: an envelope is unsettled until it is None.
        self.batch_holds: list[list[Envelope | None]] = []
        #: Envelopes waiting on a retry timer (id(envelope) -> envelope).
        self.retrying: dict[int, Envelope] = {}
        #: Over a broker: id(envelope) -> the broker delivery to settle when it is done.
        self.deliveries: dict[int, Delivery] = {}
        #: Set (then forgotten) once :attr:`deliveries` is empty, for a pump waiting for it.
        self.unheld: anyio.Event | None = None
        #: The line for room, first first (see :class:`RoomWaiter`); its first
        #: :attr:`holding` were handed room they have not taken yet.
        self.room_waiters: deque[RoomWaiter] = deque()
        self.holding = 0
        #: Places handed to the waiters that hold room.
        self.reserved = 0
        #: Free places (``capacity - queued``) needed before :meth:`hand_room` can
        #: hand anything: the room held plus what the first waiter not handed any
        #: needs (past ``capacity`` when there is none). A consumer calls
        #: :meth:`hand_room` only then, not for every envelope it takes while a batch
        #: waits for room for many.
        self.room_needed = 1
        self.consumer_waiters: deque[anyio.Event] = deque()
        #: What consumers take from, oldest first (a controlled stage: its lanes).
        self.buffer: deque[tuple[float, Envelope]] = deque()
        #: Admits an item (through the key gate of an ordered stage).
        self.push: Callable[[tuple[float, Envelope]], None] = self.buffer.append
        #: Puts an item straight into what consumers take from.
        self.enqueue: Callable[[tuple[float, Envelope]], None] = self.buffer.append
        self.pop: Callable[[], tuple[float, Envelope]] = self.buffer.popleft
        #: Whether a pump feeds this stage from the broker.
        self.pumping = False
        #: Set once the pump's broker subscription exists (its group receives publishes).
        self.subscribed: anyio.Event | None = None
        #: Ids of envelopes handled here whose settle the broker did not take (abandoned).
        self.unsettled: list[str] = []
        #: Adaptive concurrency and shedding; ``None`` for a static stage.
        self.control: StageControl | None = None
        if controlled or admission is not None:
            self.control = StageControl(self, admission)
            # Priority lanes, timed with the controllers' clock.
            self.push, self.pop = self.control.lanes.push, self.control.lanes.pop_oldest
            self.enqueue = self.push
        #: ``subscribe(partitions=...)`` of an ordered stage, ``None`` when not given.
        self.partitions: int | None = None
        #: Over a broker, the partitions this replica serves (``None``: not split).
        self.partitioned: Partitions | None = None
        #: The group's slots (``max_in_flight``); ``None`` for none.
        self.flights: FlightLimit | None = None
        #: Per-key order (``ordering="key"``); ``None`` for an unordered stage.
        self.gate: KeyGate | None = None
        if ordered:
            self.gate = KeyGate(self.enqueue, stop=stop_key_on_failure)
            self.push = self.gate.push
        #: Publishes (and replays) waiting for room or about to be admitted.
        self.entering = 0
        #: Consumers whose handler awaits ``bus.drain()`` (it does not wait for them).
        self.draining = 0
        #: Not running (not started, or stopped): nothing more may be admitted.
        self.closed = True

    # -- life cycle -------------------------------------------------------------

    @property
    def concurrency(self) -> int:
        """Consumer tasks of all subscriptions sharing this stage."""
        if self.control is not None:
            return self.control.consumers
        total = 0
        for subscription in self.subscriptions:
            # Without control every concurrency is an int (Adaptive makes a stage controlled).
            assert isinstance(subscription.concurrency, int)
            total += subscription.concurrency
        return total

    def open(self) -> None:
        """Start admitting (when the bus starts, or at once if it runs)."""
        self.closed = False

    def close(self, *, log: bool = True) -> list[str]:
        """After the consumers are gone: count what is left as abandoned.

        :param log: log the abandoned ids (the bus says it otherwise).
        :return: ids of the abandoned envelopes.
        """
        self.closed = True
        left = [envelope.id for _, envelope in self.buffer]
        self.buffer.clear()
        if self.control is not None:
            left += self.control.clear()
        if self.gate is not None:
            left += self.gate.clear()
        left += [h.envelope.id for h in self.handlings if h.envelope is not None]
        left += [held.id for holds in self.batch_holds for held in holds if held is not None]
        self.batch_holds.clear()
        left += [envelope.id for envelope in self.retrying.values()]
        self.handlings.clear()
        self.retrying.clear()
        # Unsettled broker deliveries are released by the transport's subscription.
        self.deliveries.clear()
        if self.unheld is not None:
            self.unheld.set()
        self.pumping = False
        self.ledger.abandoned += len(left)
        if log:
            self.host.failure_log.abandoned(self.name, left)
        left = self.unsettled + left  # (counted, and logged, when their settle failed)
        self.unsettled = []
        self.queued = self.in_flight = 0
        for waiter in self.room_waiters:
            waiter.event.set()  # not handed: each raises BusClosedError
        self.room_waiters.clear()
        self.holding = self.reserved = 0
        self.room_needed = 1
        self.consumer_waiters.clear()
        return left

    def withdraw(self) -> list[str]:
        """Close the stage of a running bus for good (the broker refused its
        subscription): what it held is abandoned, its consumers end once woken.

        :return: ids of the abandoned envelopes.
        """
        waiters = list(self.consumer_waiters)
        left = self.close()
        for waiter in waiters:
            waiter.set()  # (each finds the stage closed and empty, and ends)
        return left

    # -- the door ---------------------------------------------------------------

    # The room test lives here only: a new arrival may take a place when one is free
    # and nobody stands in line for room (room freed is handed to the line first).

    def has_room(self, count: int = 1) -> bool:
        """Whether ``count`` new envelopes can be admitted now without waiting or dropping."""
        return not self.room_waiters and self.capacity - self.queued >= count

    def free_room(self) -> int:
        """How many new envelopes can be admitted now without waiting (0 while some wait)."""
        return 0 if self.room_waiters else self.capacity - self.queued

    def offer(self, envelope: Envelope) -> DoorOutcome:
        """Admit ``envelope`` now if the policy allows it, without waiting."""
        if self.queued < self.capacity and not self.room_waiters:  # has_room, inlined
            self.admit(envelope)
            return DoorOutcome.ACCEPTED
        policy = self.backpressure
        if policy is Backpressure.BLOCK:
            return DoorOutcome.BLOCKED
        if policy is Backpressure.REJECT:
            self.ledger.rejected += 1
            self.host.failure_log.rejected_at_door(self.name, self.capacity, envelope)
            return DoorOutcome.REJECTED
        if policy is Backpressure.DROP_NEWEST:
            self.ledger.published += 1
            self.ledger.dead(DeadLetterReason.DROPPED)
            self.host.dead_letter(envelope, DeadLetterReason.DROPPED, None, self.name, 0)
            return DoorOutcome.DROPPED
        while self.queued >= self.capacity:
            _, oldest = self.evict()
            self.queued -= 1
            self.ledger.dead(DeadLetterReason.DROPPED)
            self.host.dead_letter(
                oldest, DeadLetterReason.DROPPED, None, self.name, tries_before(oldest)
            )
            self.host.settled(self)
        self.admit(envelope)
        return DoorOutcome.ACCEPTED

    async def put(self, envelope: Envelope) -> None:
        """Admit ``envelope``, waiting in line for room whatever the policy.

        :raises BusClosedError: when the stage stops first; nothing is admitted then.
            Cancelled while it waits, it is admitted only if room had been handed to
            it already.
        """
        if self.closed:
            raise BusClosedError(f"stage {self.name!r} stopped before it had room")
        if self.has_room():
            self.admit(envelope)
            return
        # Counted while it waits: drain() does not call the bus idle meanwhile.
        self.entering += 1
        try:
            await self.wait_in_line(self.line_up(enter=functools.partial(self.admit, envelope)))
        finally:
            self.entering -= 1
            self.host.settled(self)

    async def wait_for_room(self, bound: Callable[[], int] | None = None) -> None:
        """Wait in line until the queue holds fewer than ``capacity`` (or ``bound()``)
        envelopes; the caller admits one at once, with no await in between.

        :raises BusClosedError: when the stage stops first.
        """
        while True:
            if self.closed:
                raise BusClosedError(f"stage {self.name!r} stopped before it had room")
            if not self.room_waiters and self.queued < (
                self.capacity if bound is None else bound()
            ):
                return
            waiter = self.line_up(bound=bound)
            await self.wait_in_line(waiter)
            self.take_room(waiter)
            if self.queued < (self.capacity if bound is None else bound()):
                return
            self.hand_room()  # (its bound fell meanwhile) pass the room on, line up again

    def line_up(
        self,
        need: int = 1,
        enter: Callable[[], None] | None = None,
        bound: Callable[[], int] | None = None,
    ) -> RoomWaiter:
        """Join the line for room (see :class:`RoomWaiter`): handed it at once if the
        room is there and nobody is ahead; await :meth:`wait_in_line` next."""
        waiter = RoomWaiter(need, enter, bound)
        self.room_waiters.append(waiter)
        if len(self.room_waiters) == self.holding + 1:
            self.hand_room()  # first in line for room: there may be some now
        return waiter

    async def wait_in_line(self, waiter: RoomWaiter) -> None:
        """Wait until ``waiter`` was handed its room; however else the wait ends, it
        leaves the line (room it held is passed on).

        :raises BusClosedError: when the stage stops first.
        """
        try:
            await waiter.event.wait()
        except BaseException:  # deliberate: however the wait ends, no room is lost
            self.leave(waiter)
            raise
        if not waiter.handed:
            raise BusClosedError(f"stage {self.name!r} stopped before it had room")

    def leave(self, waiter: RoomWaiter) -> None:
        """``waiter`` gives up its place (nothing when it was admitted already); room
        handed to it goes to the next in line."""
        if waiter.handed and waiter.enter is not None:
            return
        try:
            self.room_waiters.remove(waiter)
        except ValueError:
            return  # gone already (it took its room, or the stage stopped)
        if waiter.handed:
            self.holding -= 1
            self.reserved -= waiter.need
        self.hand_room()

    def take_room(self, waiter: RoomWaiter) -> None:
        """``waiter`` (handed its room, without ``enter``) leaves the line to fill it
        now; the caller admits, then calls :meth:`hand_room` if it leaves room over.

        :raises BusClosedError: when the stage stopped after it handed the room.
        """
        if self.closed:
            raise BusClosedError(f"stage {self.name!r} stopped before it had room")
        self.room_waiters.remove(waiter)
        self.holding -= 1
        self.reserved -= waiter.need

    def hand_room(self) -> None:
        """Hand the free room to the line, first first, as far as it goes.

        A waiter with ``enter`` is admitted now, in its turn; one without holds its
        room. A waiter that needs more than there is (a batch, or a bound) stops the
        hand-over: nobody behind it gets ahead of it.
        """
        waiters = self.room_waiters
        while len(waiters) > self.holding:
            waiter = waiters[self.holding]
            limit = self.capacity if waiter.bound is None else waiter.bound()
            if limit - self.queued - self.reserved < waiter.need:
                self.room_needed = self.reserved + waiter.need
                return
            waiter.handed = True
            if waiter.enter is None:
                self.holding += 1
                self.reserved += waiter.need
            else:
                del waiters[self.holding]
                waiter.enter()
            waiter.event.set()
        self.room_needed = self.capacity + 1  # nobody left who waits for room

    def take_many(self, limit: int, into: list[Envelope | None]) -> int:
        """Take up to ``limit`` of the oldest envelopes for a batch consumer.

        They move from queued to in flight, appended to ``into``; the room they
        leave goes to the publishes waiting for it.

        :return: how many of them were sampled for timings (their latency is recorded
            once the batch is settled).
        """
        count = min(limit, self.queued)
        if not count:
            return 0
        # Popped by a loop in C (starmap), then split into admission times and envelopes.
        stamps, envelopes = zip(*starmap(self.pop, repeat((), count)), strict=True)
        into.extend(envelopes)
        sampled = 0
        if any(stamps):  # sampled at admission: one envelope in 8
            now = _clock()
            record = self.wait.record
            for admitted_at in filter(None, stamps):
                sampled += 1
                record(now - admitted_at)
        self.queued -= count
        self.in_flight += count
        if self.room_waiters:
            self.hand_room()
        return sampled

    def take_delivery(self, envelope: Envelope) -> Delivery | None:
        """The broker delivery of ``envelope``, no longer held by the stage (to settle)."""
        delivery = self.deliveries.pop(id(envelope), None)
        if self.unheld is not None and not self.deliveries:
            self.unheld.set()
        return delivery

    async def wait_unheld(self) -> None:
        """Wait until the stage holds no broker delivery (each one settled or given up).

        :raises BusClosedError: when the stage stops first.
        """
        while self.deliveries:
            if self.closed:
                raise BusClosedError(f"stage {self.name!r} stopped")
            if self.unheld is None:
                self.unheld = anyio.Event()
            try:
                await self.unheld.wait()
            finally:
                self.unheld = None
        if self.closed:
            raise BusClosedError(f"stage {self.name!r} stopped")

    def wake_consumer(self) -> None:
        """Wake one parked consumer for an envelope that arrived."""
        if self.consumer_waiters:
            self.consumer_waiters.popleft().set()

    def admit(self, envelope: Envelope) -> None:
        """Enqueue ``envelope`` as a new publish; the caller checked :meth:`has_room`."""
        ledger = self.ledger
        ledger.published += 1
        # Timings are sampled at admission: the 1st, 9th, 17th, ... envelope.
        self.push((_clock() if ledger.published & 7 == 1 else 0.0, envelope))
        self.queued += 1
        if self.consumer_waiters:
            self.consumer_waiters.popleft().set()

    def admit_waited(self, envelope: Envelope, waited: float) -> None:
        """:meth:`admit` on a controlled stage, for an envelope that already waited
        ``waited`` seconds (in a broker): its controllers count that wait too."""
        control = self.control
        assert control is not None
        self.ledger.published += 1
        if self.gate is None or self.gate.enters((0.0, envelope)):
            control.lanes.push_waited(envelope, waited)
        self.queued += 1
        if self.consumer_waiters:
            self.consumer_waiters.popleft().set()

    def admit_many(self, envelopes: list[Envelope]) -> None:
        """Enqueue ``envelopes`` (in order) as new publishes, waking consumers once.

        The caller checked there is room for all of them and nobody waits for room.
        """
        count = len(envelopes)
        ledger = self.ledger
        first = ledger.published + 1
        ledger.published += count
        if self.control is None and self.gate is None:
            # Timings sampled as admit() does (the 1st, 9th, ... envelope), one clock read;
            # the pairs made by zip, in C.
            stamps = [0.0] * count
            sampled = range((1 - first) % 8, count, 8)
            stamps[sampled.start :: 8] = [_clock()] * len(sampled)
            self.buffer.extend(zip(stamps, envelopes, strict=True))
        else:
            push = self.push
            for number, envelope in enumerate(envelopes, first):
                push((_clock() if number & 7 == 1 else 0.0, envelope))
        self.queued += count
        waiters = self.consumer_waiters
        # One wake-up per parked consumer that has an envelope to take, not one each.
        for _ in range(min(count, len(waiters))):
            waiters.popleft().set()

    @property
    def idle(self) -> bool:
        """Nothing queued, in flight, waiting for a retry or about to be admitted."""
        return not (self.queued or self.in_flight or self.entering)

    @property
    def quiet(self) -> bool:
        """Idle but for consumers whose handler is itself in ``bus.drain()``."""
        return not (self.queued or self.entering) and self.in_flight <= self.draining

    # -- retries ----------------------------------------------------------------

    async def retry_later(self, envelope: Envelope, delay: float, step: int = 1) -> None:
        """Re-enter ``envelope`` (in flight, in :attr:`retrying`) after ``delay`` seconds.

        It waits in line for room whatever the policy (it was admitted already); a
        stage that stops first keeps it in :attr:`retrying`, so the close lists it as
        abandoned. ``step``: what the envelope's attempt grows by (a retry: 1; a
        :class:`Defer`: 0).
        """
        await anyio.sleep(delay)
        again = envelope.evolve(attempt=envelope.attempt + step)
        if self.closed:
            return
        if self.has_room() or (self.gate is not None and self.gate.holds(envelope)):
            # (The holder of a key re-enters at once: its followers may fill the stage.)
            self._reenter(envelope, again)
            return
        try:
            await self.wait_in_line(
                self.line_up(enter=functools.partial(self._reenter, envelope, again))
            )
        except BusClosedError:
            return

    def _reenter(self, envelope: Envelope, again: Envelope) -> None:
        """Queue ``again``, the next attempt of the retrying ``envelope``."""
        del self.retrying[id(envelope)]
        delivery = self.deliveries.pop(id(envelope), None)
        if delivery is not None:
            self.deliveries[id(again)] = delivery
        self.in_flight -= 1
        self.enqueue((0.0, again))  # (an ordered stage: its key is still its own)
        self.queued += 1
        self.wake_consumer()

    # -- order per key ------------------------------------------------------------

    def evict(self) -> tuple[float, Envelope]:
        """Take the oldest queued item out of the stage (``DROP_OLDEST``); the caller
        counts it out of :attr:`queued`. On an ordered stage its key passes on."""
        gate = self.gate
        if gate is None:
            return self.pop()
        if len(self.buffer if self.control is None else self.control.lanes):
            oldest = self.pop()
            self.release(oldest[1])
            return oldest
        waiting = gate.evict()
        assert waiting is not None  # (queued counts the lines: something waits there)
        return waiting

    def release(self, envelope: Envelope) -> None:
        """``envelope`` was settled for good: on an ordered stage its key passes to the
        next in line (a consumer is woken for it)."""
        gate = self.gate
        if gate is not None and gate.release(envelope):
            self.wake_consumer()

    # -- statistics -------------------------------------------------------------

    def statistics(self) -> StageStatistics:
        """Snapshot this stage's ledger and timings."""
        control = self.control
        limit = control.limit if control is not None else self.concurrency
        ledger = self.ledger
        gate, flights = self.gate, self.flights
        return StageStatistics(
            name=self.name,
            topic=self.pattern,
            group=self.group,
            published=ledger.published,
            acked=ledger.acked,
            failed=ledger.failed,
            retried=ledger.retried,
            deferred=ledger.deferred,
            dead_lettered=ledger.dead_lettered,
            rejected=ledger.rejected,
            dropped=ledger.dropped,
            expired=ledger.expired,
            abandoned=ledger.abandoned,
            depth=self.queued,
            in_flight=self.in_flight,
            concurrency=self.concurrency,
            capacity=self.capacity,
            latency_p50=_finite(self.latency.quantile(0.5)),
            latency_p99=_finite(self.latency.quantile(0.99)),
            wait_p99=_finite(self.wait.quantile(0.99)),
            limit=limit,
            shedding=control is not None and control.shedding,
            shed=ledger.shed,
            saturation=min(1.0, self.busy_consumers() / limit) if limit else 0.0,
            ordering=None if gate is None else "key",
            keys_held=0 if gate is None else gate.keys_held,
            keys_waiting=0 if gate is None else gate.keys_waiting,
            waiting_for_key=0 if gate is None else gate.waiting,
            max_in_flight=None if flights is None else flights.limit,
            slots_held=0 if flights is None else flights.running,
            slots_waiting=0 if flights is None else flights.waiting,
            partitions=self.partitions,
            partitions_owned=self.partitions_owned(),
        )

    def partitions_owned(self) -> int:
        """The partitions this process serves: over a broker, those it holds now; in
        memory, every one (one process serves them all); 0 for a stage not split."""
        if self.partitioned is not None:
            return len(self.partitioned.served)
        return self.partitions or 0

    def busy_consumers(self) -> int:
        """Consumers holding work now: a batch consumer counts once, however many
        envelopes it holds, and an envelope waiting for a retry holds no consumer."""
        held = batches = 0
        for holds in self.batch_holds:
            count = len(holds) - holds.count(None)
            if count:
                held += count
                batches += 1
        return self.in_flight - len(self.retrying) - held + batches


def tries_before(envelope: Envelope) -> int:
    """Attempts made at ``envelope`` before it was queued: none for a new publish, one
    less than its ``attempt`` for a retry (which re-enters with ``attempt + 1``)."""
    return envelope.attempt - 1


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
