"""A controlled stage: adaptive consumer counts and sojourn shedding wired into a stage.

A stage is *controlled* when it was subscribed with ``admission=`` or with
``concurrency=Adaptive(...)``. Its envelopes then wait in :class:`Lanes` (priority
classes, either end servable) instead of the plain FIFO buffer, every envelope is
timed with the injected clock, and its consumers run :meth:`StageControl.consume`.
Static stages never come here: their consumer loop is the plain one in ``_stage``.
This module is the stage's other half and uses its private members.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from ._adaptive import Adaptive, ConcurrencyLimit
from ._admission import Admission, SojournShedder
from ._dead_letters import DeadLetterReason
from ._dispatch import Dispatch, Outcome, handler_failure
from ._instrument import dispatch as instrumented_dispatch
from ._lanes import Lanes
from ._stage import reject_delivery

if TYPE_CHECKING:
    from ._envelope import Envelope
    from ._stage import Stage
    from ._subscription import Subscription
    from ._types import Handler
    from .transports.base import Delivery

__all__ = ["Crew", "StageControl", "default_clock"]

logger = logging.getLogger("asyncbus")

#: The clock controlled stages read (tests replace it with a fake one).
default_clock: Callable[[], float] = anyio.current_time


class Crew:
    """The consumers of one subscription on a controlled stage."""

    __slots__ = ("chain", "in_flight", "limiter", "parked", "retiring", "running", "subscription")

    def __init__(self, subscription: Subscription, clock: Callable[[], float]) -> None:
        self.subscription = subscription
        concurrency = subscription.concurrency
        self.limiter = (
            ConcurrencyLimit(concurrency, clock) if isinstance(concurrency, Adaptive) else None
        )
        self.chain: Handler | None = None
        #: Consumer tasks alive, retiring ones included.
        self.running = 0
        #: Consumers asked to stop at their next envelope boundary.
        self.retiring = 0
        self.in_flight = 0
        #: Events of this crew's consumers parked on an empty queue.
        self.parked: list[anyio.Event] = []

    @property
    def target(self) -> int:
        """How many consumers this subscription should run now."""
        if self.limiter is not None:
            return self.limiter.limit
        concurrency = self.subscription.concurrency
        assert isinstance(concurrency, int)
        return concurrency


class StageControl:
    """The controllers of one stage and the consumer loop that obeys them.

    :param stage: the stage controlled.
    :param admission: its shedding configuration, ``None`` for none.
    :param clock: seconds, monotonic; ``anyio.current_time`` by default.
    """

    def __init__(
        self, stage: Stage, admission: Admission | None, clock: Callable[[], float] | None = None
    ) -> None:
        self.stage = stage
        self.admission = admission
        self.clock = clock if clock is not None else default_clock
        self.lanes = Lanes(self.clock)
        self.shedder = SojournShedder(admission) if admission is not None else None
        self.lifo = admission is not None and admission.lifo
        self.crews: dict[Subscription, Crew] = {}

    # -- what statistics show ------------------------------------------------------

    @property
    def limit(self) -> int:
        """The consumers the stage should run now, over all its subscriptions."""
        total = 0
        for subscription in self.stage.subscriptions:
            crew = self.crews.get(subscription)
            if crew is not None:
                total += crew.target
            else:
                concurrency = subscription.concurrency
                total += concurrency.min if isinstance(concurrency, Adaptive) else concurrency
        return total

    @property
    def consumers(self) -> int:
        """Consumer tasks alive now (retiring ones included); the limit before start."""
        if not self.crews:
            return self.limit
        return sum(crew.running for crew in self.crews.values())

    @property
    def shedding(self) -> bool:
        """Whether the stage is shedding now."""
        return self.shedder is not None and self.shedder.shedding

    def local_bound(self) -> int:
        """Most envelopes the broker pump keeps queued here: the limit, at most ``capacity``."""
        return max(1, min(self.stage.capacity, self.limit))

    # -- consumers -------------------------------------------------------------------

    def start(self, subscription: Subscription, chain: Handler) -> None:
        """Start the subscription's consumers (its limit's worth) on the running bus."""
        crew = Crew(subscription, self.clock)
        crew.chain = chain
        self.crews[subscription] = crew
        self.resize(crew)

    def resize(self, crew: Crew) -> None:
        """Start or retire consumers until the crew matches its target."""
        alive = crew.running - crew.retiring
        want = crew.target
        if want > alive:
            kept = min(crew.retiring, want - alive)  # take back retirements first
            crew.retiring -= kept
            task_group = self.stage.bus.task_group
            for _ in range(want - alive - kept):
                crew.running += 1
                task_group.start_soon(
                    self.consume, crew, name=f"asyncbus consumer {self.stage.name}"
                )
        elif want < alive:
            crew.retiring += alive - want
            # Parked consumers retire now; busy ones after the envelope they hold.
            waiters = self.stage._consumer_waiters
            for _ in range(min(alive - want, len(crew.parked))):
                event = crew.parked.pop()
                if event in waiters:
                    waiters.remove(event)
                event.set()

    def clear(self) -> list[str]:
        """The bus stopped: empty the lanes and forget the crews; return the queued ids."""
        left: list[str] = []
        while self.lanes:
            left.append(self.lanes.pop_oldest()[1].id)
        self.crews.clear()
        if self.shedder is not None:
            self.shedder.idle()
        return left

    async def consume(self, crew: Crew) -> None:
        """One consumer of ``crew``: the stage's consumer loop, under control.

        Like the static loop it yields once per envelope; it also retires between
        envelopes when the crew shrinks, sheds stale envelopes while the stage is
        shedding, and feeds each handling latency to the crew's limiter.
        """
        stage = self.stage
        bus = stage.bus
        dispatch = Dispatch(stage, bus)
        dispatch.activate()
        stage._dispatches.append(dispatch)
        chain = crew.chain
        assert chain is not None
        clock, lanes, shedder, limiter = self.clock, self.lanes, self.shedder, crew.limiter
        checkpoint = bus.yield_now
        waiters = stage._consumer_waiters
        deliveries = stage.deliveries
        while True:
            await checkpoint()  # the one yield per envelope
            if crew.retiring:
                # An envelope boundary: nothing is held, so leaving loses nothing.
                crew.retiring -= 1
                crew.running -= 1
                stage._dispatches.remove(dispatch)
                if stage.queued:
                    stage._wake_consumer()  # an admission may have woken us for an item
                return
            if not stage.queued:
                if shedder is not None:
                    shedder.idle()
                waiter = anyio.Event()
                waiters.append(waiter)
                crew.parked.append(waiter)
                try:
                    await waiter.wait()
                except BaseException:  # deliberate: however the wait ends, no wake-up is lost
                    if waiter in waiters:
                        waiters.remove(waiter)
                    elif stage.queued:
                        stage._wake_consumer()  # we were woken for an item: pass it on
                    raise
                finally:
                    if waiter in crew.parked:
                        crew.parked.remove(waiter)
                continue
            now = clock()
            newest_first = False
            if shedder is not None and shedder.observe(now - lanes.oldest_admitted(), now):
                stale = lanes.take_stale(shedder.shed_before(now))
                if stale:
                    shedder.note_shed(now)
                    await self._shed(stale)
                    if not stage.queued:
                        continue
                newest_first = self.lifo
            admitted_at, envelope = lanes.take(newest_first)
            stage.queued -= 1
            if stage.room_waiters:
                stage._wake_one()
            stage.in_flight += 1
            crew.in_flight += 1
            in_flight = crew.in_flight
            stage.wait.record(now - admitted_at)
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
            crew.in_flight -= 1
            outcome = dispatch.outcome
            if outcome is None or outcome is Outcome.SKIPPED:
                stage.acked += 1
                stage.in_flight -= 1
                if bus.idle_waiters and not stage.queued and stage.in_flight <= stage.draining:
                    bus.wake_drainers()
            if deliveries and outcome is not Outcome.DEFERRED:
                await stage._settle_delivery(
                    envelope, dispatch.dead if outcome is Outcome.DEAD else None
                )
            dispatch.envelope = None
            latency = clock() - now
            stage.latency.record(latency)
            if limiter is not None and limiter.record(latency, in_flight):
                self.resize(crew)

    async def _shed(self, stale: list[Envelope]) -> None:
        """Dead-letter ``stale`` (already out of the lanes) as ``overload``."""
        stage = self.stage
        reason = DeadLetterReason.OVERLOAD
        held: list[tuple[Envelope, Delivery]] = []
        # The ledger moves for all of them before any await: queued -> dead_lettered.
        stage.queued -= len(stale)
        for envelope in stale:
            delivery = stage.deliveries.pop(id(envelope), None)
            stage._count_dead(reason)
            stage.bus.dead_letter(
                envelope, reason, None, stage.name, 0, stored=delivery is not None
            )
            if delivery is not None:
                held.append((envelope, delivery))
        for _ in range(len(stale)):
            if not stage.room_waiters:
                break
            stage._wake_one()
        stage.bus.settled(stage)
        for envelope, delivery in held:
            try:
                with anyio.CancelScope(shield=True):
                    await reject_delivery(delivery, reason.value, None, stage.name, 0)
            except Exception:
                # The broker will deliver it again (at-least-once); locally it is shed.
                logger.warning("could not reject %s with the broker", envelope.id, exc_info=True)
