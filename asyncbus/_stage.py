"""A stage: one (pattern, group)'s bounded queue, its consumers and its ledger."""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._dead_letters import DeadLetterReason
from ._dispatch import Dispatch, Outcome, describe_error, handler_failure
from ._envelope import Envelope
from ._exceptions import BusClosedError
from ._instrument import dispatch as instrumented_dispatch
from ._stats import LatencyHistogram, StageStatistics

if TYPE_CHECKING:
    from ._admission import Admission
    from ._bus import Bus
    from ._control import StageControl
    from ._dead_letters import DeadLetter
    from ._subscription import Subscription
    from ._types import Handler
    from .transports.base import Delivery, Transport

__all__ = ["Backpressure", "DoorOutcome", "Stage"]

_clock = time.perf_counter
logger = logging.getLogger("asyncbus.stage")


class Backpressure(StrEnum):
    """What a publish does when it finds a stage's queue full."""

    #: Wait for room (up to the publish ``timeout``, then :class:`PublishTimeout`).
    BLOCK = "block"
    #: Enqueue nothing for this stage; the receipt lists it in ``rejected``.
    REJECT = "reject"
    #: Do not enqueue the new envelope; it is dead-lettered ``dropped``.
    DROP_NEWEST = "drop_newest"
    #: Evict (and dead-letter ``dropped``) the oldest queued envelope, admit the new one.
    DROP_OLDEST = "drop_oldest"


class DoorOutcome(Enum):
    """What happened at a stage's door."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    DROPPED = "dropped"
    BLOCKED = "blocked"


class Stage:
    """One subscription group on one pattern: a bounded anyio stream plus its consumers.

    Every counter here is touched only from the event-loop thread, and every change
    to the ledger happens without an ``await`` in between, so
    ``published == acked + dead_lettered + abandoned + depth + in_flight`` holds
    whenever another task can look.
    """

    def __init__(
        self,
        bus: Bus,
        pattern: str,
        group: str,
        capacity: int,
        backpressure: Backpressure,
        *,
        admission: Admission | None = None,
        controlled: bool = False,
    ) -> None:
        self.bus = bus
        self.pattern = pattern
        self.group = group
        self.name = f"{pattern}@{group}"
        #: ``(name,)``, shared by every receipt that names only this stage.
        self.names = (self.name,)
        self.capacity = capacity
        self.backpressure = backpressure
        self.subscriptions: list[Subscription] = []
        self.published = self.acked = self.failed = self.retried = 0
        self.dead_lettered = self.rejected = self.dropped = self.expired = 0
        self.abandoned = self.in_flight = self.queued = 0
        #: Envelopes shed under overload (a part of ``dead_lettered``).
        self.shed = 0
        self.latency = LatencyHistogram()
        self.wait = LatencyHistogram()
        # Where an admitted, unsettled envelope can be, besides the stream's buffer:
        # with a consumer (its Dispatch) or on a retry timer (id(envelope) -> envelope).
        self._dispatches: list[Dispatch] = []
        self._retrying: dict[int, Envelope] = {}
        #: Over a broker: id(envelope) -> the broker delivery to settle when it is done.
        self.deliveries: dict[int, Delivery] = {}
        self.room_waiters: deque[anyio.Event] = deque()
        self._send: MemoryObjectSendStream[tuple[float, Envelope]] | None = None
        self._receive: MemoryObjectReceiveStream[tuple[float, Envelope]] | None = None
        #: Whether a pump feeds this stage from the broker.
        self.pumping = False
        #: Set once the pump's broker subscription exists (its group receives publishes).
        self.subscribed: anyio.Event | None = None
        self._consumer_waiters: deque[anyio.Event] = deque()
        #: Ids of envelopes handled here whose settle the broker did not take (abandoned).
        self.unsettled: list[str] = []
        #: Adaptive concurrency and shedding; ``None`` for a static stage.
        self.control: StageControl | None = None
        if controlled or admission is not None:
            from ._control import StageControl

            self.control = StageControl(self, admission)
        #: Publishes (and replays) waiting for room or about to be admitted.
        self.entering = 0
        #: Consumers whose handler awaits ``bus.drain()`` (it does not wait for them).
        self.draining = 0
        #: No stream (not started, or stopped): nothing more may be admitted.
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

    def open_stream(self) -> None:
        """Create the bounded stream (when the bus starts, or at once if it runs)."""
        self._send, self._receive = anyio.create_memory_object_stream["tuple[float, Envelope]"](
            self.capacity
        )
        self._push: Callable[[tuple[float, Envelope]], None] = self._send.send_nowait
        self._pop: Callable[[], tuple[float, Envelope]] = self._receive.receive_nowait
        self.closed = False
        # The stage alone decides when there is room (``queued < capacity``) and no task
        # ever waits inside the stream, so its send_nowait/receive_nowait reduce to the
        # buffer's append/popleft: use those directly where anyio's layout allows.
        buffer = getattr(getattr(self._send, "_state", None), "buffer", None)
        if isinstance(buffer, deque):
            self._push, self._pop = buffer.append, buffer.popleft
        if self.control is not None:  # priority lanes, timed with the controllers' clock
            lanes = self.control.lanes
            self._push, self._pop = lanes.push, lanes.pop_oldest

    def start_consumers(self, subscription: Subscription, chain: Handler) -> None:
        """Start ``subscription.concurrency`` consumers running ``chain`` in the bus's group."""
        if self.control is not None:
            self.control.start(subscription, chain)
            return
        task_group = self.bus.task_group
        assert isinstance(subscription.concurrency, int)
        for _ in range(subscription.concurrency):
            task_group.start_soon(self._consume, chain, name=f"asyncbus consumer {self.name}")

    def close(self) -> list[str]:
        """After the consumers are gone: count what is left as abandoned, close the stream.

        :return: ids of the abandoned envelopes.
        """
        self.closed = True
        left: list[str] = []
        if self._receive is not None:
            while True:
                try:
                    left.append(self._receive.receive_nowait()[1].id)
                except anyio.WouldBlock:
                    break
        if self.control is not None:
            left += self.control.clear()
        for dispatch in self._dispatches:
            if dispatch.envelope is not None and dispatch.outcome in (None, Outcome.SKIPPED):
                left.append(dispatch.envelope.id)
        left += [envelope.id for envelope in self._retrying.values()]
        self._dispatches.clear()
        self._retrying.clear()
        # Unsettled broker deliveries are released by the transport's subscription.
        self.deliveries.clear()
        self.pumping = False
        self.abandoned += len(left)
        self.bus.failure_log.abandoned(self.name, left)
        left = self.unsettled + left  # (counted, and logged, when their settle failed)
        self.unsettled = []
        self.queued = self.in_flight = 0
        for waiter in self.room_waiters:
            waiter.set()
        self.room_waiters.clear()
        self._consumer_waiters.clear()
        if self._send is not None and self._receive is not None:
            self._send.close()
            self._receive.close()
        self._send = self._receive = None
        return left

    # -- the door ---------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether a publish can be admitted now without waiting or dropping."""
        return self.queued < self.capacity and not self.room_waiters

    def offer(self, envelope: Envelope) -> DoorOutcome:
        """Admit ``envelope`` now if the policy allows it, without waiting."""
        if self.queued < self.capacity and not self.room_waiters:
            self.admit(envelope)
            return DoorOutcome.ACCEPTED
        policy = self.backpressure
        if policy is Backpressure.BLOCK:
            return DoorOutcome.BLOCKED
        if policy is Backpressure.REJECT:
            self.rejected += 1
            self.bus.failure_log.rejected_at_door(self.name, self.capacity, envelope)
            return DoorOutcome.REJECTED
        if policy is Backpressure.DROP_NEWEST:
            return self._drop_at_door(envelope)
        while self.queued >= self.capacity:
            self._evict_oldest()
        self.admit(envelope)
        return DoorOutcome.ACCEPTED

    async def put(self, envelope: Envelope) -> None:
        """Admit ``envelope``, waiting for room whatever the policy.

        :raises BusClosedError: when the stage stops first; nothing is admitted then.
        """
        # Counted while it waits: drain() does not call the bus idle between the room
        # appearing and this envelope taking it.
        self.entering += 1
        try:
            await self._wait_for_room()
            self.admit(envelope)
        finally:
            self.entering -= 1
            if self.bus.idle_waiters:
                self.bus.settled(self)

    async def _wait_for_room(self, bound: Callable[[], int] | None = None) -> None:
        # ``bound``: a lower ceiling than ``capacity``, read again at every wake-up.
        while True:
            if self.closed:
                # Woken by the stop (or by room, too late): admitting now would put the
                # envelope where no consumer will ever take it.
                raise BusClosedError(f"stage {self.name!r} stopped before it had room")
            if self.queued < (self.capacity if bound is None else bound()):
                break
            waiter = anyio.Event()
            self.room_waiters.append(waiter)
            try:
                await waiter.wait()
            except BaseException:  # deliberate: however the wait ends, no waiter is lost
                try:
                    self.room_waiters.remove(waiter)
                except ValueError:
                    self._wake_one()  # we were handed the room: pass it on
                raise
        if self.room_waiters and self.queued < (self.capacity if bound is None else bound()):
            self._wake_one()  # room for more than us: keep the queue of waiters moving

    def _wake_one(self) -> None:
        if self.room_waiters:
            self.room_waiters.popleft().set()

    def admit(self, envelope: Envelope) -> None:
        """Enqueue ``envelope`` as a new publish; the caller checked :meth:`has_room`."""
        self.published += 1
        # Timings are sampled at admission: the 1st, 9th, 17th, ... envelope.
        self._push((_clock() if self.published & 7 == 1 else 0.0, envelope))
        self.queued += 1
        if self._consumer_waiters:
            self._consumer_waiters.popleft().set()

    @property
    def idle(self) -> bool:
        """Nothing queued, in flight, waiting for a retry or about to be admitted."""
        return not (self.queued or self.in_flight or self.entering)

    @property
    def quiet(self) -> bool:
        """Idle but for consumers whose handler is itself in ``bus.drain()``."""
        return not (self.queued or self.entering) and self.in_flight <= self.draining

    def _drop_at_door(self, envelope: Envelope) -> DoorOutcome:
        self.published += 1
        self._count_dead(DeadLetterReason.DROPPED)
        self.bus.dead_letter(envelope, DeadLetterReason.DROPPED, None, self.name, 0)
        return DoorOutcome.DROPPED

    def _evict_oldest(self) -> None:
        _, oldest = self._pop()
        self.queued -= 1
        self._count_dead(DeadLetterReason.DROPPED)
        self.bus.dead_letter(oldest, DeadLetterReason.DROPPED, None, self.name, 0)
        self.bus.settled(self)

    # -- settling ---------------------------------------------------------------

    def _count_dead(self, reason: DeadLetterReason) -> None:
        self.dead_lettered += 1
        if reason is DeadLetterReason.DROPPED:
            self.dropped += 1
        elif reason is DeadLetterReason.EXPIRED:
            self.expired += 1
        elif reason is DeadLetterReason.OVERLOAD:
            self.shed += 1

    def settle_dead(
        self,
        envelope: Envelope,
        reason: DeadLetterReason,
        error: str | None,
        *,
        failed: bool,
        cause: BaseException | None = None,
    ) -> DeadLetter | None:
        """The envelope in flight is dead: count it and hand it to the dead-letter queue."""
        if failed:
            self.failed += 1
        self._count_dead(reason)
        self.in_flight -= 1
        entry = self.bus.dead_letter(
            envelope,
            reason,
            error,
            self.name,
            envelope.attempt,
            cause,
            stored=id(envelope) in self.deliveries,
        )
        self.bus.settled(self)
        return entry

    def schedule_retry(self, envelope: Envelope, delay: float) -> None:
        """Count a failed attempt and re-enter the envelope after ``delay`` seconds."""
        self.failed += 1
        self.retried += 1
        self._retrying[id(envelope)] = envelope
        self.bus.task_group.start_soon(self._retry_later, envelope, delay)

    async def _retry_later(self, envelope: Envelope, delay: float) -> None:
        await anyio.sleep(delay)
        again = envelope.evolve(attempt=envelope.attempt + 1)
        try:
            await self._wait_for_room()
        except BusClosedError:
            return  # stopped: it stays in _retrying, so close() lists it as abandoned
        assert self._send is not None
        del self._retrying[id(envelope)]
        delivery = self.deliveries.pop(id(envelope), None)
        if delivery is not None:
            self.deliveries[id(again)] = delivery
        self.in_flight -= 1
        self._push((0.0, again))
        self.queued += 1
        self._wake_consumer()

    # -- consuming --------------------------------------------------------------

    async def _consume(self, chain: Handler) -> None:
        dispatch = Dispatch(self, self.bus)
        dispatch.activate()
        self._dispatches.append(dispatch)
        bus = self.bus
        stream = self._receive
        assert stream is not None
        receive_nowait = self._pop
        checkpoint = self.bus.yield_now
        waiters = self._consumer_waiters
        deliveries = self.deliveries  # the same dict for the stage's life
        wait_record, latency_record = self.wait.record, self.latency.record
        while True:
            # Items always sit in the stream's buffer (no consumer ever waits inside
            # anyio's receive), so ``queued`` is exactly what a stage holds and nothing
            # is ever in a hand-over that cancellation could lose.
            await checkpoint()  # the one yield per envelope
            if not self.queued:
                # Still empty after a yield: park until an admission wakes us. (The
                # yield first lets a publisher that runs in step with us refill the
                # stage without anyone paying for an Event.)
                waiter = anyio.Event()
                waiters.append(waiter)
                try:
                    await waiter.wait()  # the yield, when the stage was empty
                except BaseException:  # deliberate: however the wait ends, no wake-up is lost
                    if waiter in waiters:
                        waiters.remove(waiter)
                    elif self.queued:
                        self._wake_consumer()  # we were woken for an item: pass it on
                    raise
                if not self.queued:
                    continue
            admitted_at, envelope = receive_nowait()
            self.queued -= 1
            if self.room_waiters:
                self._wake_one()
            self.in_flight += 1
            if admitted_at:  # sampled at admission: one envelope in 8
                started = _clock()
                wait_record(started - admitted_at)
            dispatch.envelope = envelope
            dispatch.outcome = None
            instrumentation = bus._instrumentation
            if instrumentation is None:
                try:
                    await chain(envelope)
                except Exception as error:  # the chain's outermost dead-letter layer
                    dispatch.fail(error)
                except BaseException as error:  # deliberate: a stray cancellation is a failure
                    failure = handler_failure(error)
                    if failure is None:
                        raise  # the bus's own cancellation (or KeyboardInterrupt, ...)
                    dispatch.fail(failure)
            else:  # the same, between the observers' enter and exit (tracing)
                await instrumented_dispatch(instrumentation, chain, dispatch, envelope)
            outcome = dispatch.outcome
            if outcome is None or outcome is Outcome.SKIPPED:
                # Acked: counted here, inline, as this runs once per envelope.
                self.acked += 1
                self.in_flight -= 1
                if bus.idle_waiters and not self.queued and self.in_flight <= self.draining:
                    bus.wake_drainers()
            if deliveries and outcome is not Outcome.DEFERRED:
                await self._settle_delivery(
                    envelope, dispatch.dead if outcome is Outcome.DEAD else None
                )
            if admitted_at:
                latency_record(_clock() - started)
            dispatch.envelope = None

    async def _settle_delivery(self, envelope: Envelope, dead: DeadLetter | None) -> None:
        delivery = self.deliveries.pop(id(envelope), None)
        if delivery is None:
            return
        broker = self.bus.transport
        assert broker is not None  # deliveries come from a broker
        try:
            if dead is None and (ack_nowait := getattr(delivery, "ack_nowait", None)):
                ack_nowait()  # only queued for the transport's writer: nothing to shield
                return
            # Shielded (a settle is not skipped because the bus is closing), bounded by
            # the bus's close deadline.
            with broker.cleanup_scope() as scope:
                if dead is None:
                    await delivery.ack()
                else:
                    await reject_delivery(
                        delivery, dead.reason.value, dead.error, self.name, dead.attempts
                    )
            if not scope.cancelled_caught:
                return
            logger.warning("could not settle %s with the broker before closing", envelope.id)
        except Exception:
            logger.warning("could not settle %s with the broker", envelope.id, exc_info=True)
        self._unsettled(envelope, dead)

    def _unsettled(self, envelope: Envelope, dead: DeadLetter | None) -> None:
        """The broker did not take the settle: it delivers the envelope again (at-least-once).

        So it ends here as abandoned, not as acked or dead-lettered (the dead-letter
        queue keeps the entry the bus recorded).
        """
        if dead is None:
            self.ack_lost(envelope.id)
            return
        self.dead_lettered -= 1
        if dead.reason is DeadLetterReason.DROPPED:
            self.dropped -= 1
        elif dead.reason is DeadLetterReason.EXPIRED:
            self.expired -= 1
        self.abandoned += 1
        self.unsettled.append(envelope.id)

    def ack_lost(self, envelope_id: str) -> None:
        """An envelope counted acked here whose ack the broker never got: abandoned."""
        self.acked -= 1
        self.abandoned += 1
        self.unsettled.append(envelope_id)

    async def pump(self, transport: Transport) -> None:
        """Feed this stage from the broker: at most ``capacity`` deliveries held here.

        No delivery ends the pump: one that cannot be taken in (undecodable, delivered
        too often, or anything unexpected) is dead-lettered ``rejected`` and rejected.
        A controlled stage queues at most ``min(capacity, limit)`` of them (plus the
        ones its consumers hold), so the rest stays in the broker for other replicas.
        """
        subscription = transport.subscribe(self.pattern, group=self.group, prefetch=self.capacity)
        bound = self.control.local_bound if self.control is not None else None
        async with subscription as deliveries:
            if self.subscribed is not None:
                self.subscribed.set()  # the group exists in the broker from here on
            async for delivery in deliveries:
                try:
                    envelope = delivery.envelope
                    refused = getattr(delivery, "error", None)  # beyond the Delivery protocol
                    if refused is None:
                        await self._wait_for_room(bound)
                        self.deliveries[id(envelope)] = delivery
                        self.admit(envelope)
                        continue
                except Exception as error:  # a broken delivery must not end the pump
                    logger.exception("stage %s could not take in a delivery", self.name)
                    refused = f"the delivery could not be taken in: {describe_error(error)}"
                await self._refuse(delivery, str(refused))

    async def _refuse(self, delivery: Delivery, error: str) -> None:
        """Count ``delivery`` in, dead-letter it ``rejected`` and reject it, never handled."""
        envelope = getattr(delivery, "envelope", None)
        if not isinstance(envelope, Envelope):
            envelope = Envelope(topic=self.pattern, payload=None)
        self.published += 1
        self._count_dead(DeadLetterReason.REJECTED)
        entry = self.bus.dead_letter(
            envelope, DeadLetterReason.REJECTED, error, self.name, envelope.attempt, stored=True
        )
        try:
            with anyio.CancelScope(shield=True):
                await reject_delivery(
                    delivery,
                    DeadLetterReason.REJECTED.value,
                    entry.error if entry else error,
                    self.name,
                    envelope.attempt,
                )
        except Exception:
            # Left unsettled: the broker delivers it again, and it is refused again.
            logger.warning("could not reject %s with the broker", envelope.id, exc_info=True)

    def _wake_consumer(self) -> None:
        if self._consumer_waiters:
            self._consumer_waiters.popleft().set()

    # -- statistics -------------------------------------------------------------

    def statistics(self) -> StageStatistics:
        """Snapshot this stage's ledger and timings."""
        control = self.control
        limit = control.limit if control is not None else self.concurrency
        return StageStatistics(
            name=self.name,
            topic=self.pattern,
            group=self.group,
            published=self.published,
            acked=self.acked,
            failed=self.failed,
            retried=self.retried,
            dead_lettered=self.dead_lettered,
            rejected=self.rejected,
            dropped=self.dropped,
            expired=self.expired,
            abandoned=self.abandoned,
            depth=self.queued,
            in_flight=self.in_flight,
            concurrency=self.concurrency,
            capacity=self.capacity,
            latency_p50=_finite(self.latency.quantile(0.5)),
            latency_p99=_finite(self.latency.quantile(0.99)),
            wait_p99=_finite(self.wait.quantile(0.99)),
            limit=limit,
            shedding=control is not None and control.shedding,
            shed=self.shed,
            saturation=self.in_flight / limit if limit else 0.0,
        )


async def reject_delivery(
    delivery: Delivery, reason: str, error: str | None, stage: str, attempts: int
) -> None:
    """``delivery.reject(reason)``, with each of the dead letter's details it takes.

    The public ``Delivery`` protocol has ``reject(reason)``; asyncbus's own transports
    also take ``error``, ``stage`` and ``attempts`` (:class:`DetailedDelivery`) so the
    broker's copy of the dead letter matches the bus's. A transport that takes only
    some of them gets those; one written to the protocol alone still works.
    """
    details = {"error": error, "stage": stage, "attempts": attempts}
    accepted = _reject_keywords(type(delivery))
    reject: Callable[..., Awaitable[None]] = delivery.reject
    await reject(reason, **{name: details[name] for name in accepted})


_REJECT_DETAILS = frozenset({"error", "stage", "attempts"})


@functools.cache
def _reject_keywords(delivery_type: type[Delivery]) -> frozenset[str]:
    try:
        parameters = inspect.signature(delivery_type.reject).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return _REJECT_DETAILS
    named = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return _REJECT_DETAILS & {p.name for p in parameters if p.kind in named}


def _finite(value: float) -> float:
    return value if math.isfinite(value) else 0.0
