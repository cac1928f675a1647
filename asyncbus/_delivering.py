"""The broker's side of a stage: the pump that feeds it, and the settles owed the broker.

Over a broker a stage's envelopes arrive as deliveries: :func:`pump` takes them from
the transport's subscription into the stage (at most what the stage should hold),
and when a consumer settled an envelope, :func:`settle_delivery` tells the broker
(ack, or the dead letter). A delivery that cannot be taken in is refused here:
dead-lettered ``rejected`` without being handled.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio

from ._dead_letters import DeadLetter, DeadLetterReason
from ._envelope import Envelope
from ._exceptions import BusClosedError, ConfigurationError
from ._failures import describe_error, stray_cancellation
from ._stage import Stage, StageHost
from .transports.base import BaseDelivery, Delivery, SubscriptionControl

__all__ = [
    "PUMP_BACKOFF_MAX",
    "PUMP_BACKOFF_MIN",
    "DeliveryHost",
    "entry_for_broker",
    "pump",
    "reject_delivery",
    "settle_delivery",
]

logger = logging.getLogger("asyncbus.stage")


class DeliveryHost(StageHost, Protocol):
    """What the broker's side of a stage needs of the bus (one object per bus)."""

    def cleanup_scope(self) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded scope for settling with the broker, bounded by the close deadline."""

    def refused(self, stage: Stage, error: ConfigurationError) -> None:
        """The broker refused ``stage``'s subscription for good (its pump has ended).

        On the running bus the stage is withdrawn and the other stages go on; the
        error reaches ``await bus.subscribed()``. While the bus starts, the start
        fails with it.
        """


async def settle_delivery(
    stage: Stage, envelope: Envelope, dead: DeadLetter | None, host: DeliveryHost
) -> None:
    """Tell the broker how ``envelope``'s delivery ended: acked (``dead`` is ``None``) or
    dead-lettered as ``dead``.

    The ledger moved already; a settle the broker does not take turns the envelope's
    end into abandoned (the broker delivers it again).
    """
    delivery = stage.take_delivery(envelope)
    if delivery is None:
        return
    try:
        if dead is None and isinstance(delivery, BaseDelivery) and delivery.acks_behind:
            delivery.ack_nowait()  # only queued for the transport's writer: no shield
            return
        # Shielded (a settle is not skipped because the bus is closing), bounded by the
        # bus's close deadline.
        with host.cleanup_scope() as scope:
            if dead is None:
                await delivery.ack()
            else:
                await reject_delivery(delivery, dead)
        if not scope.cancelled_caught:
            return
        logger.warning("could not settle %s with the broker before closing", envelope.id)
    except Exception:
        logger.warning("could not settle %s with the broker", envelope.id, exc_info=True)
    # The broker did not take the settle: it delivers the envelope again
    # (at-least-once), so it ends here as abandoned, not as acked or dead-lettered
    # (the dead-letter queue keeps the entry the bus recorded).
    if dead is None:
        stage.ledger.ack_lost()
    else:
        stage.ledger.dead_unsettled(dead.reason)
    stage.unsettled.append(envelope.id)


#: First pause (seconds) before a stage subscribes to its broker again after a failure.
PUMP_BACKOFF_MIN = 0.05
#: Longest pause between two tries: how late consuming resumes once the broker is back.
PUMP_BACKOFF_MAX = 2.0


class Tap(Protocol):
    """A pump of one partition of a stage (see :mod:`asyncbus._partitions`)."""

    #: The partition is being handed over: take nothing more in.
    leaving: bool
    #: The pump's reading now (cancelled to stop taking envelopes in).
    reading: anyio.CancelScope | None
    #: Set once the partition's subscription exists (its group receives publishes).
    subscribed: anyio.Event


async def pump(
    stage: Stage,
    transport: Any,
    host: DeliveryHost,
    *,
    group: str | None = None,
    accept: Callable[[Any], bool] | None = None,
    tap: Tap | None = None,
) -> None:
    """Feed ``stage`` from the broker: at most ``capacity`` deliveries held here.

    No delivery ends the pump: one that cannot be taken in (undecodable, delivered
    too often, or anything unexpected) is dead-lettered ``rejected`` and rejected.
    A controlled stage queues at most ``min(capacity, limit)`` of them (plus the
    ones its consumers hold), and its subscription holds no more than that, so the
    rest stays in the broker for other replicas (see :func:`_pump_once`).

    Nor does the broker: a subscription that cannot be made or that fails (the
    broker is down or refuses for a moment) is logged and made again, after a pause
    that doubles up to :data:`PUMP_BACKOFF_MAX` seconds, until the bus stops. Only a
    :class:`ConfigurationError` (a pattern or setting the broker can never take)
    ends it, handed to the host (``refused``): the other stages go on.

    A partition of the stage (``tap``) reads its own ``group``; a delivery ``accept``
    says is another partition's is acked at once, uncounted. When the partition is
    handed over (``tap.reading`` cancelled) the pump reads no more but keeps its
    subscription, for what it took in to be settled, until it is cancelled.
    """
    backoff = PUMP_BACKOFF_MIN
    while True:
        began = anyio.current_time()
        try:
            await _pump_once(stage, transport, host, group, accept, tap)
            return  # the subscription ended: the transport is closing
        except ConfigurationError as error:
            host.refused(stage, error)  # never again: the stage is withdrawn, or the start fails
            return
        except (Exception, anyio.get_cancelled_exc_class()) as error:
            # Deliberate: nothing the broker does ends the bus. A cancellation nobody
            # asked of this task (a client library cancelling what it awaited, a
            # connection it gave up on) fails the subscription like any error: left to
            # end the task, it would stop the bus's whole task group.
            if not isinstance(error, Exception) and not stray_cancellation():
                raise
            if anyio.current_time() - began > PUMP_BACKOFF_MAX:
                backoff = PUMP_BACKOFF_MIN  # it worked for a while: a new failure
            pause = backoff * random.uniform(0.5, 1.0)
            logger.warning(
                "stage %s: subscribing to the broker failed, trying again in %.2f s: %s",
                stage.name,
                pause,
                describe_error(error),
            )
        await anyio.sleep(pause)
        backoff = min(backoff * 2, PUMP_BACKOFF_MAX)


async def _pump_once(
    stage: Stage,
    transport: Any,
    host: DeliveryHost,
    group: str | None = None,
    accept: Callable[[Any], bool] | None = None,
    tap: Tap | None = None,
) -> None:
    """One subscription of ``stage``, until it ends.

    Its prefetch is what the stage should hold: ``capacity`` for a static stage, the
    window of a controlled one (``min(capacity, limit)`` queued plus ``limit`` in its
    consumers, followed as the limit moves). A *suspect* (a message whose consumer
    died or hung with it: ``redeliveries``) is handled alone, so that if it kills this
    process too, the broker counts that death for it and for nothing else: the
    prefetch drops to 1 (what was received beside it goes back uncounted), the suspect
    waits until the stage holds no other delivery and the broker has their settles,
    and the prefetch comes back with the next delivery that is not one. (Only with a
    subscription the bus can steer, :class:`~asyncbus.transports.SubscriptionControl`;
    otherwise it keeps the prefetch it subscribed with. Not on an ordered stage: what
    came with a suspect, put back, would come after later envelopes of its keys.)

    A controlled stage counts a delivery's wait from when the broker queued it
    (``queued_at``): over a broker the queue that stands is the broker's, so that is
    the wait admission control sheds by.
    """
    control = stage.control
    window = control.window if control is not None else None
    prefetch = window() if window is not None else stage.capacity
    subscription = transport.subscribe(
        stage.pattern, group=stage.group if group is None else group, prefetch=prefetch
    )
    async with subscription as deliveries:
        if tap is None:
            if stage.subscribed is not None:
                stage.subscribed.set()  # the group exists in the broker from here on
            await _take_in(stage, deliveries, host, accept, prefetch)
            return
        tap.subscribed.set()
        tap.reading = reading = anyio.CancelScope()
        if tap.leaving:
            reading.cancel()
        with reading:
            await _take_in(stage, deliveries, host, accept, prefetch)
        if reading.cancelled_caught or tap.leaving:
            await anyio.sleep_forever()  # handed over: hold what was taken in until told


async def _take_in(
    stage: Stage,
    deliveries: Any,
    host: DeliveryHost,
    accept: Callable[[Any], bool] | None,
    prefetch: int,
) -> None:
    """Admit ``deliveries`` (subscribed with ``prefetch``) into ``stage`` until the
    subscription ends (see :func:`_pump_once`)."""
    control = stage.control
    bound = control.local_bound if control is not None else None
    window = control.window if control is not None else None
    steered = deliveries if isinstance(deliveries, SubscriptionControl) else None
    if stage.gate is not None:
        # An ordered stage takes a suspect in line: putting back what came with it would
        # send those behind later envelopes of their keys.
        steered = None
    async for delivery in deliveries:
        if accept is not None and not accept(delivery):
            await _pass_over(stage, delivery)
            continue
        try:
            envelope = delivery.envelope
            # (A delivery written to the Delivery protocol alone is taken as decoded.)
            refused = delivery.error if isinstance(delivery, BaseDelivery) else None
            if refused is None:
                if steered is not None:
                    suspect = isinstance(delivery, BaseDelivery) and delivery.redeliveries > 0
                    full = window() if window is not None else stage.capacity
                    wanted = 1 if suspect else full
                    if wanted != prefetch:
                        prefetch = wanted
                        await steered.set_prefetch(wanted)
                    if suspect:  # it runs with nothing held beside it
                        await stage.wait_unheld()
                        await _flush(stage, steered)
                await stage.wait_for_room(bound)
                stage.deliveries[id(envelope)] = delivery
                since = (
                    delivery.queued_at()
                    if control is not None and isinstance(delivery, BaseDelivery)
                    else None
                )
                if since is None:
                    stage.admit(envelope)
                else:  # its wait began in the broker (the wall clock: the broker's)
                    stage.admit_waited(envelope, max(0.0, time.time() - since))
                continue
        except BusClosedError:
            return  # the stage stopped: the subscription gives back what it holds
        except Exception as error:  # a broken delivery must not end the pump
            logger.exception("stage %s could not take in a delivery", stage.name)
            refused = f"the delivery could not be taken in: {describe_error(error)}"
        await _refuse(stage, delivery, str(refused), host)


async def _pass_over(stage: Stage, delivery: Delivery) -> None:
    """Ack a delivery of another partition of ``stage``, unhandled and uncounted."""
    try:
        if isinstance(delivery, BaseDelivery) and delivery.acks_behind:
            delivery.ack_nowait()
        else:
            await delivery.ack()
    except Exception as error:  # it comes back, and is passed over again
        logger.warning(
            "stage %s: another partition's delivery was not acked: %s",
            stage.name,
            describe_error(error),
        )


async def _flush(stage: Stage, subscription: SubscriptionControl) -> None:
    """Have the broker take every settle of ``subscription`` made so far (a failure is
    logged: what it did not take may come back, as at-least-once allows)."""
    try:
        with anyio.CancelScope(shield=True):
            await subscription.flush()
    except Exception as error:
        logger.warning(
            "stage %s: settles not written before a suspect: %s", stage.name, describe_error(error)
        )


async def _refuse(stage: Stage, delivery: Delivery, error: str, host: DeliveryHost) -> None:
    """Count ``delivery`` in, dead-letter it ``rejected`` and reject it, never handled."""
    envelope = getattr(delivery, "envelope", None)
    if not isinstance(envelope, Envelope):
        envelope = Envelope(topic=stage.pattern, payload=None)
    stage.ledger.published += 1
    stage.ledger.dead(DeadLetterReason.REJECTED)
    entry = host.dead_letter(
        envelope, DeadLetterReason.REJECTED, error, stage.name, envelope.attempt, stored=True
    )
    told = entry_for_broker(
        entry, envelope, DeadLetterReason.REJECTED, error, stage.name, envelope.attempt
    )
    try:
        with anyio.CancelScope(shield=True):
            await reject_delivery(delivery, told)
    except Exception:
        # Left unsettled: the broker delivers it again, and it is refused again.
        logger.warning("could not reject %s with the broker", envelope.id, exc_info=True)


def entry_for_broker(
    entry: DeadLetter | None,
    envelope: Envelope,
    reason: DeadLetterReason,
    error: str | None,
    stage: str,
    attempts: int,
) -> DeadLetter:
    """The dead letter a rejected delivery hands its broker: the bus's ``entry``, or for a
    ``$deadletter`` envelope (which the bus records none of: one never begets another)
    one made here from the same details."""
    if entry is not None:
        return entry
    return DeadLetter(envelope, reason, error, stage, attempts, time.time())


async def reject_delivery(delivery: Delivery, entry: DeadLetter) -> None:
    """``delivery.reject``, handed the bus's dead letter as it is (built once, by the bus).

    asyncbus's transports (:class:`BaseDelivery`) store that entry, so the broker's copy
    is the bus's; a delivery written to the ``Delivery`` protocol alone is given the
    reason only.
    """
    if isinstance(delivery, BaseDelivery):
        await delivery.reject(entry)
    else:
        await delivery.reject(entry.reason.value)
