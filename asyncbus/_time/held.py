"""Scheduled envelopes held by the bus itself until they are due (the bus in memory).

:class:`LocalKeeper` keeps them in a heap ordered by due time and one task publishes
each when it comes, as a publish at that moment would be. Nothing here outlives the
process: what is still held when the bus closes is abandoned, logged and listed in the
:class:`~asyncbus.ShutdownReport` (over a broker, :mod:`.broker` keeps them instead).
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio

from .._envelope import Envelope, Receipt
from .._exceptions import ConfigurationError
from .._failures import describe_error
from .due import BusTime, as_datetime

__all__ = ["Fire", "Keeper", "LocalKeeper", "ScheduledEnvelope"]

logger = logging.getLogger("asyncbus.schedule")

#: Publishes an envelope that came due (as a publish at that moment would be).
Fire = Callable[[Envelope], Awaitable[Receipt]]


@dataclass(frozen=True, slots=True)
class ScheduledEnvelope:
    """An envelope published with ``delay=`` or ``at=`` that is not due yet.

    :ivar id: the envelope's id (the receipt's; :meth:`Bus.cancel_scheduled` takes it).
    :ivar topic: where it will be published.
    :ivar due: when, as an aware UTC datetime.
    :ivar envelope: the envelope as it will be published (its ``timestamp`` is set anew
        when it is).
    """

    id: str
    topic: str
    due: dt.datetime
    envelope: Envelope


class Keeper(Protocol):
    """Where a bus keeps its scheduled envelopes until they are due (its mode chooses)."""

    @property
    def count(self) -> int:
        """Scheduled envelopes not due yet (this process's)."""

    def listed(self) -> list[ScheduledEnvelope]:
        """Those envelopes, soonest first."""

    async def hold(self, envelopes: Sequence[Envelope], due: float) -> None:
        """Keep ``envelopes`` until ``due`` (epoch seconds), then fire them."""

    async def cancel(self, envelope_id: str) -> bool:
        """Never fire ``envelope_id``; whether it was still pending."""

    async def run(self, running: Callable[[], bool]) -> None:
        """Fire what comes due while ``running()``, until cancelled."""

    def abandon(self) -> list[str]:
        """The bus closed: the ids of what this process still held (then nothing)."""


class _Held:
    __slots__ = ("due", "envelope", "turn")

    def __init__(self, envelope: Envelope, due: float, turn: int) -> None:
        self.envelope = envelope
        self.due = due
        self.turn = turn


class LocalKeeper:
    """Holds scheduled envelopes in this process until they are due, then fires them."""

    def __init__(self, clock: BusTime, fire: Fire) -> None:
        self._clock = clock
        self._fire = fire
        self._held: dict[str, _Held] = {}
        #: (the loop's clock at due time, turn, id); cancelled ones are skipped when met.
        self._heap: list[tuple[float, int, str]] = []
        self._turns = itertools.count()
        #: Set when a sooner envelope is held (made when the keeper runs, on its loop).
        self._wake: anyio.Event | None = None

    @property
    def count(self) -> int:
        """Envelopes held now."""
        return len(self._held)

    def listed(self) -> list[ScheduledEnvelope]:
        """What is held, soonest first."""
        held = sorted(self._held.values(), key=lambda item: (item.due, item.turn))
        return [
            ScheduledEnvelope(
                item.envelope.id, item.envelope.topic, as_datetime(item.due), item.envelope
            )
            for item in held
        ]

    async def hold(self, envelopes: Sequence[Envelope], due: float) -> None:
        """Keep ``envelopes`` until ``due`` (epoch seconds).

        :raises ConfigurationError: one of their ids is already held (nothing is held).
        """
        for envelope in envelopes:
            if envelope.id in self._held:
                raise ConfigurationError(
                    f"publish({envelope.topic!r}): an envelope with id {envelope.id!r} is "
                    "already scheduled (cancel it first)"
                )
        deadline = self._clock.loop_deadline(due)
        earliest = self._heap[0][0] if self._heap else None
        for envelope in envelopes:
            turn = next(self._turns)
            self._held[envelope.id] = _Held(envelope, due, turn)
            heapq.heappush(self._heap, (deadline, turn, envelope.id))
        if (earliest is None or deadline < earliest) and self._wake is not None:
            self._wake.set()

    async def cancel(self, envelope_id: str) -> bool:
        """Forget the held envelope ``envelope_id``; whether it was still held."""
        return self._held.pop(envelope_id, None) is not None

    def _next(self) -> float | None:
        """The loop's clock reading when the soonest held envelope is due."""
        heap, held = self._heap, self._held
        while heap:
            deadline, turn, envelope_id = heap[0]
            item = held.get(envelope_id)
            if item is not None and item.turn == turn:
                return deadline
            heapq.heappop(heap)  # cancelled (or cancelled and held again)
        return None

    async def run(self, running: Callable[[], bool]) -> None:
        """Fire each envelope when it is due, in due order, while ``running()``; until
        cancelled (the bus's stop)."""
        while True:
            deadline = self._next() if running() else None  # closing: nothing new goes out
            wake = self._wake = anyio.Event()
            with anyio.CancelScope(deadline=deadline if deadline is not None else float("inf")):
                await wake.wait()
            if not running():
                continue  # (the rest is abandoned at the close)
            now = anyio.current_time()
            while (deadline := self._next()) is not None and deadline <= now:
                _, _, envelope_id = heapq.heappop(self._heap)
                item = self._held.pop(envelope_id)
                try:
                    await self._fire(item.envelope)
                except Exception as error:  # the publish's own failure: said, not raised
                    logger.error(
                        "scheduled envelope %s for %r could not be published: %s",
                        envelope_id,
                        item.envelope.topic,
                        describe_error(error),
                    )

    def abandon(self) -> list[str]:
        """The bus closed: the ids of what is still held (then nothing is)."""
        ids = [item.envelope.id for item in sorted(self._held.values(), key=lambda i: i.turn)]
        self._held.clear()
        self._heap.clear()
        if ids:
            logger.warning(
                "%d scheduled envelope(s) not due yet were abandoned at the close: %s",
                len(ids),
                ", ".join(ids[:10]) + (" ..." if len(ids) > 10 else ""),
            )
        return ids
