"""The settle-once delivery every asyncbus transport hands out.

:class:`BaseDelivery` holds what all of them share: the envelope, ``error`` (why its
body could not be decoded), the guard that settles a delivery exactly once (a
second ``ack``, ``nack`` or ``reject``, or one after the transport took it back,
raises :class:`~asyncbus.TransportError` naming why), and the one ``reject``
signature. A transport subclasses it and writes what each verb does with its
broker; it is re-exported as :class:`asyncbus.transports.BaseDelivery`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import ClassVar

from ..._dead_letters import DeadLetter, DeadLetterReason
from ..._envelope import Envelope
from ..._exceptions import TransportError

__all__ = ["SETTLED", "BaseDelivery", "rejected_entry"]

#: Why a delivery cannot be settled (again): it was.
SETTLED = "was already settled"


def rejected_entry(
    envelope: Envelope,
    reason: str,
    error: str | None,
    stage: str | None,
    attempts: int | None,
    dead_at: float,
) -> DeadLetter:
    """The dead letter a delivery's ``reject`` stores: ``attempts`` (the last attempt,
    when retries ran) also becomes the stored envelope's ``attempt``.

    :raises ValueError: when ``reason`` is not a :class:`~asyncbus.DeadLetterReason` value.
    """
    why = DeadLetterReason(reason)
    if attempts is not None and attempts != envelope.attempt:
        envelope = envelope.evolve(attempt=attempts)
    return DeadLetter(envelope, why, error, stage, envelope.attempt, dead_at)


class BaseDelivery:
    """A delivery settled exactly once: the base of every asyncbus transport's deliveries.

    Subclasses implement :meth:`_ack` (or, when the transport writes acks behind,
    :class:`~asyncbus.transports.base.AcksWrittenBehind`, set :attr:`acks_behind` and
    implement :meth:`_queue_ack` instead), :meth:`_nack` and :meth:`_reject`; one of
    them is called at most once, after the delivery was marked settled. :meth:`_settled` runs
    when the delivery is marked settled, whatever the verb (make room for another).

    The bus gives deliveries of this class the dead letter's details on ``reject``
    and reads their ``error``; a delivery written to the
    :class:`~asyncbus.transports.Delivery` protocol alone is rejected with the reason
    only and is taken as decoded.

    :ivar envelope: the envelope; when ``error`` is set its payload is the raw body.
    :ivar error: why the body could not be decoded (or why the transport will not
        have it handled, e.g. delivered too often), else ``None``: the bus
        dead-letters such a delivery ``rejected`` without handling it.
    :ivar redeliveries: how many times the broker delivered the message before this
        one without it being settled (a consumer that died or hung with it); hand-backs
        (a subscription giving back what it held, unhandled) do not count. A delivery
        with any is a *suspect*: the bus handles it alone (see ``pump``).
    """

    __slots__ = ("_gone", "envelope", "error", "redeliveries")

    #: Whether :meth:`ack_nowait` queues the ack for a writer (else it raises).
    acks_behind: ClassVar[bool] = False

    def __init__(self, envelope: Envelope, error: str | None = None) -> None:
        self.envelope = envelope
        self.error = error
        self.redeliveries = 0
        #: Why it can no longer be settled (``None``: it can).
        self._gone: str | None = None

    @property
    def settleable(self) -> bool:
        """Whether it can still be settled (not settled, nor taken back)."""
        return self._gone is None

    def take_back(self, why: str) -> None:
        """The transport took it back unsettled (released, expired, its connection
        lost...): settling it from now on raises, saying ``why`` (a verb phrase,
        ``"was released when its subscription ended"``)."""
        self._gone = why

    def _claim(self) -> None:
        if self._gone is not None:
            raise TransportError(f"delivery of {self.envelope.id} {self._gone}")
        self._gone = SETTLED
        self._settled()

    async def ack(self) -> None:
        """Done: the broker forgets it (written behind when :attr:`acks_behind`)."""
        self._claim()
        if self.acks_behind:
            self._queue_ack()
        else:
            await self._ack()

    def ack_nowait(self) -> None:
        """:meth:`ack` without awaiting: queue the ack for the transport's writer, which
        writes it within a moment (one that dies first gets it redelivered).

        :raises TransportError: when this transport awaits its acks (``acks_behind``
            is false), or the delivery cannot be settled.
        """
        if not self.acks_behind:
            raise TransportError(f"{type(self).__name__} acks are awaited: use ack()")
        if self._gone is not None:  # (``_claim`` inlined: once per envelope)
            raise TransportError(f"delivery of {self.envelope.id} {self._gone}")
        self._gone = SETTLED
        self._settled()
        self._queue_ack()

    async def nack(self, *, delay: float | None = None) -> None:
        """Not done: deliver it again (attempt + 1) to the group after ``delay`` seconds."""
        self._claim()
        await self._nack(delay)

    async def reject(
        self,
        reason: str | DeadLetter,
        *,
        error: str | None = None,
        stage: str | None = None,
        attempts: int | None = None,
    ) -> None:
        """Give up: store the dead letter, then forget the delivery.

        :param reason: the dead letter the bus recorded, stored as it is (its
            ``attempts`` also the stored envelope's ``attempt``); or a
            :class:`~asyncbus.DeadLetterReason` value, with the details below, for a
            caller that has no entry (the ``Delivery`` protocol's form).
        :param error: what went wrong (the handler's exception, the decoding error).
        :param stage: the stage (``"pattern@group"``) that gave up.
        :param attempts: the attempt that failed last when the bus retried it (also
            the stored envelope's ``attempt``); ``None``: the delivery's.
        :raises ValueError: for an unknown reason (the delivery stays unsettled).
        """
        if isinstance(reason, DeadLetter):
            entry = reason
            if entry.attempts != entry.envelope.attempt:
                entry = replace(entry, envelope=entry.envelope.evolve(attempt=entry.attempts))
        else:
            entry = rejected_entry(self.envelope, reason, error, stage, attempts, time.time())
        self._claim()
        await self._reject(entry)

    def queued_at(self) -> float | None:
        """When the broker queued the message for its group (epoch seconds, the broker's
        clock where it has one), or ``None`` when the transport cannot tell.

        A stage with admission control counts a delivery's wait from then: over a
        broker the queue that stands is the broker's.
        """
        return None

    def _settled(self) -> None:
        """Marked settled (by any verb): a hook for the transport's bookkeeping."""

    async def _ack(self) -> None:
        raise NotImplementedError

    def _queue_ack(self) -> None:
        raise NotImplementedError

    async def _nack(self, delay: float | None) -> None:
        raise NotImplementedError

    async def _reject(self, entry: DeadLetter) -> None:
        raise NotImplementedError
