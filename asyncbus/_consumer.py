"""A stage's consumers: take an envelope, run the chain, and settle it in one place.

Each consumer task loops: one yield, take the oldest envelope (or park until one is
admitted), run the chain, then :func:`settle` what the chain decided. The chain's
result is either a verdict (``_verdicts``: skip, retry after a delay, dead-letter)
or anything else, which acks; an exception that escapes the chain is a failure and
dead-letters. ``settle`` is the only place that moves the stage's ledger for an
envelope a consumer held, starts retry timers, records dead letters and, over a
broker, acks or rejects the delivery.

A controlled stage (adaptive concurrency, shedding) runs :func:`consume_controlled`,
the same loop obeying its controllers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import anyio

from . import _instrument
from ._control import Crew
from ._dead_letters import DeadLetter, DeadLetterReason
from ._delivering import DeliveryHost, entry_for_broker, reject_delivery, settle_delivery
from ._envelope import Envelope
from ._failures import stray_cancellation
from ._handling import Handling, HandlingHost
from ._instrument import Instrumentation, Result
from ._stage import Stage, tries_before
from ._subscription import Subscription
from ._types import Handler
from ._verdicts import DeadLetterNow, Defer, GiveBack, RetryAfter, Skip, Verdict, escaped_verdict
from .transports.base import Delivery

__all__ = [
    "ConsumerHost",
    "conclude",
    "consume",
    "consume_controlled",
    "settle",
    "shed",
    "start_consumers",
]

_clock = time.perf_counter
logger = logging.getLogger("asyncbus.stage")


class ConsumerHost(DeliveryHost, HandlingHost, Protocol):
    """What consumers need of the bus that runs them (one object per bus)."""

    #: The backend's checkpoint: the consumer's one yield per envelope.
    yield_now: Callable[[], Awaitable[None]]
    #: Told around each dispatch when set (tracing, carried contextvars).
    instrumentation: Instrumentation | None
    #: ``drain()`` calls waiting; the consumer tells the host only when there are some.
    idle_waiters: list[Any]

    def consumer_info(self, stage: Stage) -> _instrument.Consumer:
        """How ``stage`` is described to the instrumentation."""

    async def halt(self, error: BaseException) -> NoReturn:
        """A handler raised ``error`` (``KeyboardInterrupt``, ``SystemExit``): stop the bus.

        The bus stops at once and its ``async with`` raises ``error``; the calling
        consumer keeps its envelope until the stop cancels it (listed as abandoned).
        Never returns.
        """


def start_consumers(
    stage: Stage, subscription: Subscription, chain: Handler, host: ConsumerHost
) -> None:
    """Start ``subscription``'s consumers on ``stage``, each running ``chain``."""
    name = f"asyncbus consumer {stage.name}"
    control = stage.control
    if control is not None:

        def spawn(crew: Crew) -> None:
            host.start_soon(consume_controlled, stage, crew, host, name=name)

        control.start(subscription, chain, spawn)
        return
    assert isinstance(subscription.concurrency, int)
    for _ in range(subscription.concurrency):
        host.start_soon(consume, stage, chain, host, name=name)


async def _run(chain: Handler, envelope: Envelope, host: ConsumerHost) -> Any:
    """``chain(envelope)``'s verdict or result; a failure that escaped it as a verdict."""
    try:
        return await chain(envelope)
    except BaseException as error:  # deliberate: the one decision, escaped_verdict
        verdict = escaped_verdict(error)  # (re-raises the bus's own cancellation)
        if verdict is None:
            await host.halt(error)  # KeyboardInterrupt, SystemExit: stop the bus
        return verdict


async def consume(stage: Stage, chain: Handler, host: ConsumerHost) -> None:
    """One consumer of a static stage: take, run, settle; one yield per envelope."""
    handling = Handling(stage, host)
    handling.activate()
    stage.handlings.append(handling)
    checkpoint = host.yield_now
    waiters = stage.consumer_waiters
    ledger = stage.ledger
    pop = stage.pop
    # What the consumers take from: on an ordered stage, ``queued`` also counts the
    # envelopes waiting for their key, which no consumer may take yet.
    takeable = stage.buffer
    gate = stage.gate
    deliveries = stage.deliveries  # the same dict for the stage's life
    wait_record, latency_record = stage.wait.record, stage.latency.record
    cancelled = anyio.get_cancelled_exc_class()
    while True:
        # Items always sit in the stage's buffer (no consumer ever waits inside a
        # stream), so ``queued`` is exactly what a stage holds and nothing is ever in a
        # hand-over that cancellation could lose.
        try:
            await checkpoint()  # the one yield per envelope
        except cancelled:
            if not stray_cancellation():
                raise
            _cancelled_from_outside(stage)
            continue
        if not takeable:
            if stage.closed:
                return  # withdrawn (the broker refused its subscription): nothing comes
            # Still empty after a yield: park until an admission wakes us. (The yield
            # first lets a publisher that runs in step with us refill the stage without
            # anyone paying for an Event.)
            waiter = anyio.Event()
            waiters.append(waiter)
            try:
                await waiter.wait()  # the yield, when the stage was empty
            except BaseException as error:  # deliberate: however it ends, no wake-up is lost
                if waiter in waiters:
                    waiters.remove(waiter)
                elif takeable:
                    stage.wake_consumer()  # we were woken for an item: pass it on
                if not isinstance(error, cancelled) or not stray_cancellation():
                    raise
                _cancelled_from_outside(stage)
                continue
            if not takeable:
                continue
        admitted_at, envelope = pop()
        stage.queued -= 1
        if stage.room_waiters and stage.capacity - stage.queued >= stage.room_needed:
            stage.hand_room()
        stage.in_flight += 1
        if admitted_at:  # sampled at admission: one envelope in 8
            started = _clock()
            wait_record(started - admitted_at)
        handling.envelope = envelope
        instrumentation = host.instrumentation
        if instrumentation is not None:  # the same, between the observers' enter and exit
            await _dispatch_observed(instrumentation, chain, stage, envelope, handling, host)
        else:
            # ``_run``, inlined: this runs once per envelope.
            try:
                result = await chain(envelope)
            except BaseException as error:  # deliberate: the one decision, escaped_verdict
                result = escaped_verdict(error)  # (re-raises the bus's own cancellation)
                if result is None:
                    await host.halt(error)  # KeyboardInterrupt, SystemExit: stop the bus
            if not isinstance(result, Verdict) and not deliveries:
                # Acked, in memory: counted here, inline, as this runs once per envelope.
                handling.envelope = None
                ledger.acked += 1
                stage.in_flight -= 1
                if gate is not None:
                    stage.release(envelope)
                if host.idle_waiters:
                    host.settled(stage)
            else:
                await settle(stage, handling, envelope, result, host)
        if admitted_at:
            latency_record(_clock() - started)


async def consume_controlled(stage: Stage, crew: Crew, host: ConsumerHost) -> None:
    """One consumer of a controlled stage's ``crew``: the consumer loop, under control.

    Like the static loop it yields once per envelope; it also retires between
    envelopes when the crew shrinks, sheds stale envelopes while the stage is
    shedding, and feeds each handling latency to the crew's limiter.
    """
    control = stage.control
    assert control is not None
    handling = Handling(stage, host)
    handling.activate()
    stage.handlings.append(handling)
    chain = crew.chain
    clock, lanes, shedder, limiter = control.clock, control.lanes, control.shedder, crew.limiter
    checkpoint = host.yield_now
    waiters = stage.consumer_waiters
    cancelled = anyio.get_cancelled_exc_class()
    while True:
        try:
            await checkpoint()  # the one yield per envelope
        except cancelled:
            if not stray_cancellation():
                raise
            _cancelled_from_outside(stage)
            continue
        if crew.retiring:
            # An envelope boundary: nothing is held, so leaving loses nothing.
            crew.retiring -= 1
            crew.running -= 1
            stage.handlings.remove(handling)
            if lanes:
                stage.wake_consumer()  # an admission may have woken us for an item
            return
        if not lanes:  # (an ordered stage's envelopes waiting for their key are not in it)
            if stage.closed:
                return  # withdrawn (the broker refused its subscription): nothing comes
            if shedder is not None:
                shedder.idle()
            waiter = anyio.Event()
            waiters.append(waiter)
            crew.parked.append(waiter)
            try:
                await waiter.wait()
            except BaseException as error:  # deliberate: however it ends, no wake-up is lost
                if waiter in waiters:
                    waiters.remove(waiter)
                elif lanes:
                    stage.wake_consumer()  # we were woken for an item: pass it on
                if not isinstance(error, cancelled) or not stray_cancellation():
                    raise
                _cancelled_from_outside(stage)
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
                await shed(stage, stale, host)
                # Looked at afresh: what was admitted meanwhile may have waited too
                # (over a broker its wait began there).
                continue
            newest_first = control.lifo
        admitted_at, envelope = lanes.take(newest_first)
        stage.queued -= 1
        if stage.room_waiters and stage.capacity - stage.queued >= stage.room_needed:
            stage.hand_room()
        stage.in_flight += 1
        crew.in_flight += 1
        in_flight = crew.in_flight
        stage.wait.record(now - admitted_at)
        handling.envelope = envelope
        instrumentation = host.instrumentation
        if instrumentation is not None:  # the same, between the observers' enter and exit
            await _dispatch_observed(instrumentation, chain, stage, envelope, handling, host)
            crew.in_flight -= 1
        else:
            result = await _run(chain, envelope, host)
            crew.in_flight -= 1
            await settle(stage, handling, envelope, result, host)
        latency = clock() - now
        stage.latency.record(latency)
        if limiter is not None and limiter.record(latency, in_flight):
            control.resize(crew)


def _cancelled_from_outside(stage: Stage) -> None:
    """A consumer between envelopes met a stray cancellation: it goes on consuming."""
    logger.warning(
        "a consumer of stage %r was cancelled from outside the bus (not a stop); it goes on",
        stage.name,
    )


async def settle(
    stage: Stage, handling: Handling, envelope: Envelope, verdict: Any, host: ConsumerHost
) -> None:
    """Carry out what the chain decided for ``envelope``, which a consumer of ``stage`` held.

    ``verdict`` is a :class:`Verdict`, or any other result (an ack). The ledger moves
    for it before any await (:func:`conclude`); then, over a broker, the delivery is
    acked or rejected (a retry keeps it until the last attempt).
    """
    retrying, dead = conclude(stage, handling, envelope, verdict, host)
    if stage.deliveries and not retrying:
        await settle_delivery(stage, envelope, dead, host)


def conclude(
    stage: Stage, handling: Handling, envelope: Envelope, verdict: Any, host: ConsumerHost
) -> tuple[bool, DeadLetter | None]:
    """The ledger's part of :func:`settle`, without an await.

    :return: whether a retry keeps the envelope, and its dead letter when it died.
    """
    ledger = stage.ledger
    handling.envelope = None  # settled from here on: the close does not list it
    if isinstance(verdict, RetryAfter):
        ledger.failed += 1
        ledger.retried += 1
        host.failure_log.retrying(stage.name, envelope, verdict.delay, verdict.cause)
        stage.retrying[id(envelope)] = envelope  # still in flight while it waits
        host.start_soon(stage.retry_later, envelope, verdict.delay)
        return True, None
    if isinstance(verdict, Defer):
        ledger.deferred += 1
        stage.retrying[id(envelope)] = envelope  # in flight while it waits, as a retry
        host.start_soon(stage.retry_later, envelope, verdict.delay, 0)
        return True, None
    if isinstance(verdict, DeadLetterNow):
        if verdict.cause is not None:
            ledger.failed += 1
        ledger.dead(verdict.reason)
        stage.in_flight -= 1
        dead = host.dead_letter(
            envelope,
            verdict.reason,
            verdict.error,
            stage.name,
            envelope.attempt,
            verdict.cause,
            stored=id(envelope) in stage.deliveries,
        )
        gate = stage.gate
        if gate is not None:
            if gate.stop:
                _stop_key(stage, envelope, host)
            else:
                stage.release(envelope)
        host.settled(stage)
        return False, dead
    if isinstance(verdict, GiveBack):
        ledger.abandoned += 1
        stage.in_flight -= 1
        stage.take_delivery(envelope)  # never settled here: the broker has it back
        if stage.gate is not None:
            stage.release(envelope)
        host.settled(stage)
        return False, None
    # An ack: a result, or Skip.
    ledger.acked += 1
    stage.in_flight -= 1
    if stage.gate is not None:
        stage.release(envelope)
    if host.idle_waiters:
        host.settled(stage)
    return False, None


def _stop_key(stage: Stage, envelope: Envelope, host: ConsumerHost) -> None:
    """``envelope`` was dead-lettered on an ordered stage with ``key_failure="stop"``:
    the envelopes waiting for its key are dead-lettered ``key_stopped`` with it."""
    assert stage.gate is not None
    followers = stage.gate.give_up(envelope)
    if followers:
        held = dead_letter_queued(stage, followers, DeadLetterReason.KEY_STOPPED, host)
        if held:
            host.start_soon(reject_held, held)


async def shed(stage: Stage, stale: list[Envelope], host: ConsumerHost) -> None:
    """Dead-letter ``stale`` (already out of the lanes) as ``overload``."""
    if stage.gate is not None:
        for envelope in stale:
            stage.release(envelope)  # (each held its key: the next of it may go on)
    await reject_held(dead_letter_queued(stage, stale, DeadLetterReason.OVERLOAD, host))


def dead_letter_queued(
    stage: Stage, envelopes: list[Envelope], reason: DeadLetterReason, host: ConsumerHost
) -> list[tuple[DeadLetter, Delivery]]:
    """Dead-letter ``envelopes``, queued on ``stage`` (and already out of its queue), for
    ``reason``; the ledger moves for all of them at once, without an await.

    :return: each broker delivery among them with its entry, for :func:`reject_held`.
    """
    held: list[tuple[DeadLetter, Delivery]] = []
    stage.queued -= len(envelopes)
    for envelope in envelopes:
        delivery = stage.take_delivery(envelope)
        stage.ledger.dead(reason)
        attempts = tries_before(envelope)
        entry = host.dead_letter(
            envelope, reason, None, stage.name, attempts, stored=delivery is not None
        )
        if delivery is not None:
            held.append(
                (entry_for_broker(entry, envelope, reason, None, stage.name, attempts), delivery)
            )
    if stage.room_waiters:
        stage.hand_room()
    host.settled(stage)
    return held


async def reject_held(held: list[tuple[DeadLetter, Delivery]]) -> None:
    """Tell the broker each of ``held``'s deliveries was dead-lettered (its entry)."""
    for entry, delivery in held:
        try:
            with anyio.CancelScope(shield=True):
                await reject_delivery(delivery, entry)
        except Exception:
            # The broker will deliver it again (at-least-once); locally it is shed.
            logger.warning("could not reject %s with the broker", entry.envelope.id, exc_info=True)


# -- instrumented dispatch -------------------------------------------------------


async def _dispatch_observed(
    instrumentation: Instrumentation,
    chain: Handler,
    stage: Stage,
    envelope: Envelope,
    handling: Handling,
    host: ConsumerHost,
) -> None:
    """Run and settle ``envelope`` between the instrumentation's ``enter`` and ``exit``.

    The exit comes once the ledger moved (a dead letter is recorded, and announced,
    inside the dispatch), before the broker is told.
    """
    token = _instrument.enter(instrumentation, host.consumer_info(stage), envelope)
    try:
        result = await chain(envelope)
    except BaseException as error:  # deliberate: the one decision, escaped_verdict
        try:
            result = escaped_verdict(error)
        except BaseException:  # the bus's own cancellation: the attempt is abandoned
            _instrument.exit(instrumentation, token, Result("abandoned", exception=error))
            raise
        if result is None:  # KeyboardInterrupt, SystemExit: abandoned, and the bus stops
            _instrument.exit(instrumentation, token, Result("abandoned", exception=error))
            await host.halt(error)
    retrying, dead = conclude(stage, handling, envelope, result, host)
    _instrument.exit(instrumentation, token, _result(result))
    if stage.deliveries and not retrying:
        await settle_delivery(stage, envelope, dead, host)


def _result(verdict: Any) -> Result:
    if isinstance(verdict, DeadLetterNow):
        return Result(
            "dead_lettered",
            reason=verdict.reason.value,
            error=verdict.error,
            exception=verdict.cause,
        )
    if isinstance(verdict, RetryAfter):
        return Result("retry", delay=verdict.delay, exception=verdict.cause)
    if isinstance(verdict, Defer):
        return Result("deferred", delay=verdict.delay)
    if isinstance(verdict, Skip):
        return _SKIPPED
    if isinstance(verdict, GiveBack):
        return _ABANDONED
    return _ACKED


_ACKED = Result("acked")
_SKIPPED = Result("skipped")
_ABANDONED = Result("abandoned")
