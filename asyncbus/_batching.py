"""A batch stage's consumers: take up to ``max_size`` envelopes, call the handler once.

Each consumer loops: one yield, take what is queued (up to ``max_size``), wait up to
``max_wait`` for more when it is fewer, then run the batch and settle each envelope
on its own (``_consumer.conclude``: the ledger counts envelopes, a retry re-enters
one envelope, a dead letter names one).

Two ways to run a batch (``_chain.BatchPlan``):

* **fast**, when the chain is pass-through but for a retry policy: this loop expires,
  decodes, calls the handler once, then forwards results along slips and turns each
  failure into its verdict (the retry policy's, else a dead letter) for the whole list,
  with no task or coroutine per envelope. It asks the layers it stands in for: which
  envelopes expire (``expire.may_expire_any``, ``may_expire``, ``expired``), which results are
  forwarded (``routing_slip.forwards_any``, ``forwards``) and what a failure becomes
  (the ``Retry`` layer's own decision); no rule of theirs is restated here;
* **per envelope** otherwise (user middleware, ``deduplicate``, an instrumentation):
  a task per envelope runs the chain, whose innermost layer joins the batch
  (``_batch.Gather``); once every envelope joined or finished, the handler is called
  once here and each chain gets its own outcome.
"""

from __future__ import annotations

import operator
import time
import typing
from collections.abc import Sequence
from typing import Any

import anyio

from . import _instrument
from ._batch import AllAcked, Failed, Gather, PartlyFailed, enter_member, unnamed
from ._chain import BatchPlan
from ._consumer import (
    ConsumerHost,
    _cancelled_from_outside,
    _result,
    _run,
    conclude,
    logger,
)
from ._consumer import start_consumers as start_message_consumers
from ._delivering import settle_delivery
from ._envelope import Envelope
from ._failures import handler_failure, stray_cancellation
from ._handling import Handling
from ._instrument import Result
from ._stage import Stage
from ._subscription import Subscription
from ._types import Handler
from ._verdicts import DeadLetterNow, Verdict
from .middleware.expire import EXPIRED, expired, may_expire, may_expire_any
from .middleware.retry import Retry
from .middleware.routing_slip import forwards, forwards_any
from .transports.base import BaseDelivery

__all__ = ["consume_batch", "start_consumers"]

_clock = time.perf_counter
_payload = operator.attrgetter("payload")


def start_consumers(
    stage: Stage, subscription: Subscription, chain: Handler, host: ConsumerHost
) -> None:
    """Start ``subscription``'s consumers on ``stage``: batch consumers for a batch."""
    if not isinstance(chain, BatchPlan):
        start_message_consumers(stage, subscription, chain, host)
        return
    assert isinstance(subscription.concurrency, int)  # (batch= refuses Adaptive)
    name = f"asyncbus batch consumer {stage.name}"
    for _ in range(subscription.concurrency):
        host.start_soon(consume_batch, stage, chain, host, name=name)


class _Filler:
    """A parked batch consumer that wants ``need`` more envelopes: an admission that
    leaves fewer queued puts it back in line instead of waking it (one wake-up per
    batch, not one per envelope, while publishes arrive one at a time)."""

    __slots__ = ("event", "need", "stage")

    def __init__(self, stage: Stage, need: int) -> None:
        self.stage = stage
        self.need = need
        self.event = anyio.Event()

    def set(self) -> None:
        stage = self.stage
        if stage.queued >= self.need or _starved(stage) or stage.closed:
            self.event.set()
        else:
            stage.consumer_waiters.append(typing.cast("anyio.Event", self))

    async def wait(self) -> None:
        await self.event.wait()


def _starved(stage: Stage) -> bool:
    """Over a broker, whether the stage holds every delivery its subscription may
    (``prefetch`` = capacity): none comes until one is settled, so a batch waiting to
    fill would wait out ``max_wait`` for nothing (the stage's other consumers hold the
    rest, each waiting too, when ``concurrency * max_size`` exceeds the capacity)."""
    return len(stage.deliveries) >= stage.capacity


async def _park(stage: Stage, need: int = 1) -> bool:
    """Wait until an admission wakes us (once ``need`` are queued); ``False`` after a
    stray cancellation."""
    waiters = stage.consumer_waiters
    waiter = anyio.Event() if need <= 1 else typing.cast("anyio.Event", _Filler(stage, need))
    waiters.append(waiter)
    try:
        await waiter.wait()
    except BaseException as error:  # deliberate: however it ends, no wake-up is lost
        if waiter in waiters:
            waiters.remove(waiter)
        elif stage.queued:
            stage.wake_consumer()  # we were woken for an item: pass it on
        if not isinstance(error, anyio.get_cancelled_exc_class()) or not stray_cancellation():
            raise
        _cancelled_from_outside(stage)
        return False
    return True


async def consume_batch(stage: Stage, plan: BatchPlan, host: ConsumerHost) -> None:
    """One consumer of a batch subscription: take a batch, run it, settle each envelope."""
    handling = Handling(stage, host)
    handling.activate()
    stage.handlings.append(handling)
    held: list[Envelope | None] = []
    stage.batch_holds.append(held)
    handling.batch = held  # (drain() in the handler does not wait for these)
    checkpoint = host.yield_now
    cancelled = anyio.get_cancelled_exc_class()
    max_size, max_wait = plan.batch.max_size, plan.batch.max_wait
    while True:
        try:
            await checkpoint()  # the one yield per batch
        except cancelled:
            if not stray_cancellation():
                raise
            _cancelled_from_outside(stage)
            continue
        if not stage.queued:
            if stage.closed:
                return  # withdrawn (the broker refused its subscription): nothing comes
            await _park(stage)
            if not stage.queued:
                continue
        sampled = stage.take_many(max_size, held)
        if len(held) < max_size and max_wait:
            with anyio.move_on_after(max_wait):
                while len(held) < max_size:
                    need = max_size - len(held)
                    if stage.queued < need and (_starved(stage) or not await _park(stage, need)):
                        break
                    sampled += stage.take_many(need, held)
            if stage.queued and len(held) < max_size:
                # What arrived while we waited, fewer than would fill the batch.
                sampled += stage.take_many(max_size - len(held), held)
        envelopes = typing.cast("list[Envelope]", held.copy())
        started = _clock()
        if plan.fast and host.instrumentation is None:
            await _run_fast(stage, plan, envelopes, held, handling, host)
        else:
            await _run_each(stage, plan, envelopes, held, host)
        held.clear()
        if sampled:
            # One sample per batch that holds a sampled envelope: they all took as long.
            stage.latency.record(_clock() - started)


async def _run_fast(
    stage: Stage,
    plan: BatchPlan,
    envelopes: list[Envelope],
    held: list[Envelope | None],
    handling: Handling,
    host: ConsumerHost,
) -> None:
    """Expire, decode, call once, forward and settle, for the whole list at once."""
    extract = plan.extract
    count = len(envelopes)
    if extract is None and not may_expire_any(envelopes):
        # The common case: nothing to expire or decode.
        items = list(map(_payload, envelopes))
        members: Sequence[int] = range(count)
    else:
        items, members = await _admit(stage, plan, envelopes, held, handling, host)
        if not members:
            return
    try:
        each = await plan.call(items)
    except BaseException as error:  # deliberate: only what is not a failure gets here
        if not isinstance(error, anyio.get_cancelled_exc_class()):
            await host.halt(error)  # KeyboardInterrupt, SystemExit: stop the bus
        raise
    deliveries = stage.deliveries
    ledger = stage.ledger
    if isinstance(each, AllAcked) and not forwards_any(envelopes):
        # Every one acked, nothing to forward: counted at once; over a broker whose
        # acks are written behind, each delivery's ack queued here, without an await.
        if len(members) == len(held):  # all of them (their positions are distinct)
            held[:] = [None] * len(held)
        else:
            for position in members:
                held[position] = None
        ledger.acked += len(members)
        stage.in_flight -= len(members)
        if deliveries:
            awaited = _ack_behind(stage, [envelopes[position] for position in members])
            for envelope in awaited:
                await settle_delivery(stage, envelope, None, host)
        if host.idle_waiters:
            host.settled(stage)
        return
    retry = plan.retry
    partly = isinstance(each, PartlyFailed)
    for position, outcome in zip(members, each, strict=True):
        envelope = envelopes[position]
        verdict: Any
        if outcome is None and partly:
            outcome = unnamed(envelope)  # acked with no result: None, or a dead letter
        if isinstance(outcome, Failed):
            verdict = _retry_or_dead(outcome.error, envelope, retry)
        elif isinstance(outcome, Verdict):
            verdict = outcome
        else:
            verdict = outcome
            if forwards(envelope):
                try:
                    await host.forward(envelope, outcome)
                except Exception as error:  # as the routing_slip layer's failure would be
                    verdict = DeadLetterNow.for_failure(error)
            elif not deliveries:
                # Acked, in memory: counted inline, as this runs once per envelope.
                held[position] = None
                ledger.acked += 1
                stage.in_flight -= 1
                continue
        await _conclude(stage, handling, envelope, held, position, verdict, host)
    if host.idle_waiters:
        host.settled(stage)


def _ack_behind(stage: Stage, acked: list[Envelope]) -> list[Envelope]:
    """Queue the ack of each of ``acked``'s deliveries that acks behind (as
    ``_settle_delivery`` would, a refused one counted abandoned); the envelopes whose
    deliveries must be awaited instead."""
    deliveries = stage.deliveries
    awaited: list[Envelope] = []
    for envelope in acked:
        delivery = deliveries.get(id(envelope))
        if delivery is None:
            continue
        if not (isinstance(delivery, BaseDelivery) and delivery.acks_behind):
            awaited.append(envelope)
            continue
        stage.take_delivery(envelope)
        try:
            delivery.ack_nowait()
        except Exception:
            logger.warning("could not settle %s with the broker", envelope.id, exc_info=True)
            stage.ledger.ack_lost()  # the broker delivers it again
            stage.unsettled.append(envelope.id)
    return awaited


async def _admit(
    stage: Stage,
    plan: BatchPlan,
    envelopes: list[Envelope],
    held: list[Envelope | None],
    handling: Handling,
    host: ConsumerHost,
) -> tuple[list[Any], list[int]]:
    """The items for the call and their positions; expired and undecodable envelopes
    are dead-lettered here, never handed to the handler."""
    extract = plan.extract
    items: list[Any] = []
    members: list[int] = []
    early: list[tuple[int, Verdict]] = []
    now = 0.0
    for position, envelope in enumerate(envelopes):
        if may_expire(envelope):
            now = now or time.time()
            if expired(envelope, now):
                early.append((position, EXPIRED))
                continue
        if extract is None:
            items.append(envelope.payload)
        else:
            try:
                items.append(extract(envelope))
            except Exception as error:  # a DecodeError: rejected, never handled
                early.append((position, DeadLetterNow.for_failure(error)))
                continue
        members.append(position)
    for position, refused in early:
        await _conclude(stage, handling, envelopes[position], held, position, refused, host)
    return items, members


def _retry_or_dead(error: BaseException, envelope: Envelope, retry: Retry | None) -> Verdict:
    """What the retry layer, then the dead-letter layer, decide for a failed envelope."""
    if retry is not None and (again := retry._retry_after(error, envelope.attempt)) is not None:
        return again
    return DeadLetterNow.for_failure(error)


async def _conclude(
    stage: Stage,
    handling: Handling,
    envelope: Envelope,
    held: list[Envelope | None],
    position: int,
    verdict: Any,
    host: ConsumerHost,
) -> None:
    held[position] = None
    retrying, dead = conclude(stage, handling, envelope, verdict, host)
    if stage.deliveries and not retrying:
        await settle_delivery(stage, envelope, dead, host)


async def _run_each(
    stage: Stage,
    plan: BatchPlan,
    envelopes: list[Envelope],
    held: list[Envelope | None],
    host: ConsumerHost,
) -> None:
    """A task per envelope runs the chain; their innermost layers join one call.

    Copies of one envelope (the same id, delivered twice) go to separate calls, one
    after the other: a middleware keyed by the id (``deduplicate`` with a broker's
    store waits for the other copy's outcome) must not wait for a copy in its own call.
    """
    rounds: list[list[int]] = []
    copies: dict[str, int] = {}
    for position, envelope in enumerate(envelopes):
        copy = copies.get(envelope.id, 0)
        copies[envelope.id] = copy + 1
        if copy == len(rounds):
            rounds.append([])
        rounds[copy].append(position)
    for positions in rounds:
        await _gather(stage, plan, envelopes, positions, held, host)


async def _gather(
    stage: Stage,
    plan: BatchPlan,
    envelopes: list[Envelope],
    positions: list[int],
    held: list[Envelope | None],
    host: ConsumerHost,
) -> None:
    gather = Gather(len(positions), anyio.current_effective_deadline())
    try:
        async with anyio.create_task_group() as group:
            for position in positions:
                group.start_soon(
                    _member, stage, plan, gather, position, envelopes[position], held, host
                )
            await gather.ready.wait()
            await gather.run(plan.call)
    except BaseException as error:  # deliberate: only what is not a failure gets here
        if handler_failure(error) is None and not isinstance(
            error, anyio.get_cancelled_exc_class()
        ):
            await host.halt(error)  # KeyboardInterrupt, SystemExit: stop the bus
        raise


async def _member(
    stage: Stage,
    plan: BatchPlan,
    gather: Gather,
    position: int,
    envelope: Envelope,
    held: list[Envelope | None],
    host: ConsumerHost,
) -> None:
    """One envelope of a batch: its chain (joining the batch), then its settle."""
    enter_member(gather, position)
    handling = Handling(stage, host)
    handling.envelope = envelope
    handling.batch = held  # (a drain() in a middleware leaves out the whole batch)
    handling.activate()
    instrumentation = host.instrumentation
    token = None
    if instrumentation is not None:
        token = _instrument.enter(instrumentation, host.consumer_info(stage), envelope)
    try:
        result = await _run(plan.chain, envelope, host)
    except BaseException as error:  # cancelled: the attempt is abandoned; close what opened
        if instrumentation is not None:
            _instrument.exit(instrumentation, token, Result("abandoned", exception=error))
        raise
    finally:
        gather.finished(position)
    held[position] = None
    retrying, dead = conclude(stage, handling, envelope, result, host)
    if instrumentation is not None:
        _instrument.exit(instrumentation, token, _result(result))
    if stage.deliveries and not retrying:
        await settle_delivery(stage, envelope, dead, host)
