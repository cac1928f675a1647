"""What a bus does differently in memory and over a broker: the :class:`Mode` protocol.

A bus holds one mode, chosen when it is made (:func:`asyncbus._modes.choose_mode`);
this module is the contract between the bus and its mode, and what a mode needs of
the bus (:class:`ModeHost`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol

import anyio

from .._cluster import Heartbeats
from .._consumer import ConsumerHost
from .._dead_letters import DeadLetter, DeadLetterQueue
from .._dedup import DedupStore
from .._envelope import Envelope, Receipt
from .._groups import GroupInfo
from .._leases import LeaseStore
from .._partitions import Partitions
from .._rates import RateStore
from .._stage import Stage
from .._time.due import BusTime
from .._time.held import Fire, Keeper

__all__ = ["CLOSE_GRACE", "INBOX", "Mode", "ModeHost", "Progress"]

#: Topics of request inboxes over a broker: "_reply.<bus instance>.<request id>".
INBOX = "_reply."

#: Seconds at the end of an ``aclose`` deadline kept for closing with a broker
#: (settling, releasing deliveries, closing connections); at most a quarter of it.
CLOSE_GRACE = 1.0


class Progress(Protocol):
    """A caller that may be cancelled while its publish waits: told what was admitted."""

    receipt: Receipt | None


class ModeHost(ConsumerHost, Protocol):
    """What a mode needs of the bus: the consumers' services and background tasks."""

    def start_background(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any
    ) -> None:
        """Run ``function(*args)`` in the bus's task group, counted until it ends
        (``drain()`` waits for it); nothing when the bus is not running."""


class Mode(Protocol):
    """What a bus does differently in memory and over a broker (one per bus)."""

    #: The transport's name for what the bus sends (``"memory"`` in its stages).
    system: str
    #: Whether a publish may be admitted into the stages inline (no broker round trip).
    admits_inline: bool

    async def open(self, stack: AsyncExitStack, dead_letters: DeadLetterQueue) -> None:
        """Start: enter the transport (closed with ``stack``), restore its dead letters."""

    def close_by(self, deadline: float) -> float:
        """A stop was asked for by ``deadline``: the deadline left for draining."""

    def publish_yield(
        self, yield_now: Callable[[], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """What a publish awaits before it admits anything, given the backend's yield.

        Every publish yields once (the fairness rule): in memory that is ``yield_now``,
        before anything is admitted; over a broker the wait for the broker's
        confirmation is the yield, and before sending only a cancellation is checked.
        """

    def lost_acks(self) -> Iterable[tuple[str, str]]:
        """``(stage name, envelope id)`` of acks the broker never got (they come back)."""

    async def backlog(self, stages: Iterable[Stage]) -> int:
        """Envelopes still held elsewhere for ``stages`` (``drain()`` waits for them)."""

    def start(self, stage: Stage) -> None:
        """``stage`` got consumers: feed it from the broker if it has one."""

    def check_pattern(self, pattern: str) -> None:
        """Raise :class:`ConfigurationError` for a pattern the broker cannot carry (at
        ``subscribe``, before anything changes)."""

    def partitions(self, stage: Stage, count: int | None) -> Partitions | None:
        """What serves an ordered stage's ``count`` partitions here (``None``: the stage
        is not split, as in memory)."""

    def check_partitions(self, pattern: str, partitions: int | None) -> None:
        """Raise :class:`ConfigurationError` when an ordered group cannot be split into
        ``partitions`` here (at ``subscribe``, before anything changes)."""

    def check_topic(self, topic: str) -> None:
        """Raise :class:`ConfigurationError` for a topic the broker cannot carry (before
        anything is sent)."""

    def check_nowait(self) -> None:
        """Raise :class:`anyio.WouldBlock` when a publish cannot complete without waiting."""

    async def send(
        self, envelope: Envelope, timeout: float | None, progress: Progress | None = None
    ) -> Receipt:
        """Route ``envelope`` to every group of its topic (observers are told first)."""

    def send_now(self, envelope: Envelope) -> Receipt:
        """Route ``envelope`` without waiting (see :meth:`check_nowait`)."""

    async def send_many(
        self, envelopes: Sequence[Envelope], timeout: float | None
    ) -> list[Receipt]:
        """Route ``envelopes`` (one topic, at least one), in order: one receipt each.

        ``timeout`` bounds the whole call; on expiry (or a stop) the error carries the
        receipts of the envelopes sent before it (``receipts``) and the partial
        receipt of the one it cut off (``receipt``); later ones are not sent.
        """

    async def send_none(self) -> list[Receipt]:
        """A ``publish_many`` of no payloads: nothing is sent; ``[]``, after the call's
        yield if :meth:`publish_yield` left it to the broker's wait."""

    def store(self, entry: DeadLetter) -> None:
        """Keep ``entry`` where other processes see it too (nothing in memory)."""

    def forget(self, ids: Sequence[str], everything: bool = False) -> None:
        """The dead letters ``ids`` (every one, when ``everything``) left the queue:
        forget their stored copies."""

    async def replay(self, entry: DeadLetter, envelope: Envelope) -> Receipt:
        """Send ``envelope`` (``entry``'s, made new) to the stage that dead-lettered it."""

    def replies_elsewhere(self, reply_to: str) -> bool:
        """Whether ``reply_to`` names a requester in another process."""

    async def reply_address(self, request_id: str, inbox: Callable[[], Awaitable[str]]) -> str:
        """Where the reply to request ``request_id`` goes (``inbox`` opens this bus's)."""

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, ``None`` in memory or without one."""

    def rate_store(self) -> RateStore | None:
        """The broker's shared rate-limit turns, ``None`` in memory or without them."""

    def lease_store(self) -> LeaseStore | None:
        """The broker's shared ``max_in_flight`` slots, ``None`` in memory or without them."""

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope for settling with the broker, bounded by the close deadline."""

    def time_keeper(self, clock: BusTime, fire: Fire) -> Keeper:
        """Where envelopes published with ``delay=``/``at=`` wait until they are due
        (``fire`` publishes one then): this process in memory, the broker otherwise."""

    def claim_store(self) -> tuple[DedupStore, bool]:
        """The store where scheduled envelopes and the ticks of periodic schedules are
        claimed, and whether every replica shares it (the broker's) or it is this
        process's own."""

    def heartbeats(self) -> Heartbeats | None:
        """Where this process's heartbeats go for the deployment's view
        (``Bus.cluster_statistics``): the transport if it keeps them, else ``None``."""

    def groups_now(self, running: bool) -> list[GroupInfo]:
        """The groups as the bus knows them now, without reaching a broker (the plain
        ``bus.groups()``: in memory exact, over a broker the latest reading)."""

    async def groups(self, running: bool) -> list[GroupInfo]:
        """The groups bound per pattern (``bus.groups()``); ``running``: whether the bus
        runs (a broker is only reached while it does)."""

    async def delete_group(self, pattern: str, group: str, force: bool, running: bool) -> bool:
        """Delete a group and its backlog (``bus.delete_group()``); whether it existed."""
