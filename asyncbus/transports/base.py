"""The transport contract: where envelopes wait between publish and handle.

The core a bus needs of every transport is small: :class:`Transport` (``publish``,
``subscribe``, ``capabilities``, ``async with``, and :meth:`Transport.bind`, the one
call through which the bus hands over its settings) and the :class:`Delivery`
protocol (``ack``, ``nack``, ``reject`` with one signature). What only some brokers
offer is an optional protocol of its own, checked once (``isinstance``) when the bus
binds the transport: :class:`RoutedPublisher`, :class:`GroupPublisher`,
:class:`BacklogReader`, :class:`DeadLetterStore` (and :class:`SharedDeadLetters`),
:class:`DedupStoreProvider`, :class:`RateStoreProvider`, :class:`LeaseStoreProvider`,
:class:`PartitionLeasesProvider`, :class:`TickClaimsProvider`,
:class:`AcksWrittenBehind`, :class:`KeepAlive`, :class:`GroupAdmin`. Everything
else (retry, expiry, timeouts, slips, requests, statistics) is the bus's, written once.
"""

from __future__ import annotations

import abc
import math
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import ClassVar, Protocol, Self, runtime_checkable

import anyio
from anyio.abc import AsyncResource

from .._dead_letters import DeadLetter, DeadLetterKey
from .._dedup import DedupStore
from .._envelope import Envelope
from .._exceptions import ConfigurationError
from .._groups import GroupAdmin, GroupInfo
from .._leases import LeaseStore, PartitionLeases
from .._rates import RateStore
from ._codec import Codec, default_codec
from ._kit.delivery import BaseDelivery

__all__ = [
    "AcksWrittenBehind",
    "BacklogReader",
    "BaseDelivery",
    "Capabilities",
    "DeadLetterChange",
    "DeadLetterStore",
    "DedupStoreProvider",
    "Delivery",
    "GroupAdmin",
    "GroupInfo",
    "GroupPublisher",
    "KeepAlive",
    "LeaseStoreProvider",
    "PartitionLeasesProvider",
    "RateStoreProvider",
    "RoutedPublisher",
    "SharedDeadLetters",
    "SubscriptionControl",
    "TickClaimsProvider",
    "TopicLimits",
    "Transport",
    "TransportSettings",
]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a transport can do natively (the conformance suite's feature flags).

    :ivar delayed_nack: ``nack(delay=)`` redelivers after the delay.
    :ivar dedup: the broker drops a second publish of the same envelope id.
    :ivar per_message_ttl: the broker expires envelopes by their own ``ttl``.
    :ivar replay: dead letters are kept by the broker and can be listed and replayed.
    :ivar durable: envelopes survive a restart of the process (and of the broker).
    :ivar ordered: one consumer of a group sees one topic's envelopes in publish order.
    """

    delayed_nack: bool = False
    dedup: bool = False
    per_message_ttl: bool = False
    replay: bool = False
    durable: bool = False
    ordered: bool = True


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """What a transport's broker can carry as a topic or a subscription pattern, beyond
    the bus's own syntax (:attr:`Transport.limits`).

    The bus refuses what is beyond them with :class:`ConfigurationError` at its door
    (``subscribe`` for a pattern, ``publish`` for a topic), before the broker sees it:
    a broker given a name it cannot carry may fail far from the cause (NATS closes the
    connection of a subject longer than its protocol line).

    :ivar max_topic_bytes: longest topic, in UTF-8 bytes (``None``: no limit).
    :ivar max_pattern_bytes: longest pattern, in UTF-8 bytes (``None``: no limit).
    :ivar forbidden: the characters the broker cannot carry, as a regular-expression
        character class (``r"[\\s]"``; empty: none).
    :ivar why: what sets the limits, for the error (``"AMQP's 255-byte routing keys"``).
    """

    max_topic_bytes: int | None = None
    max_pattern_bytes: int | None = None
    forbidden: str = ""
    why: str = ""
    _forbidden: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_forbidden", re.compile(self.forbidden) if self.forbidden else None
        )

    def check_topic(self, topic: str) -> None:
        """Raise :class:`ConfigurationError` unless the broker can carry ``topic``."""
        self._check("topic", topic, self.max_topic_bytes)

    def check_pattern(self, pattern: str) -> None:
        """Raise :class:`ConfigurationError` unless the broker can carry ``pattern``."""
        self._check("pattern", pattern, self.max_pattern_bytes)

    def _check(self, kind: str, name: str, most: int | None) -> None:
        # (A UTF-8 character is at most 4 bytes: most names need no encoding.)
        if most is not None and len(name) * 4 > most:
            size = len(name.encode("utf-8", "surrogatepass"))
            if size > most:
                raise ConfigurationError(
                    f"{kind} {_shown(name)} is {size} bytes, over the {most} bytes the "
                    f"broker can carry{self._because()}"
                )
        if self._forbidden is not None:
            found = self._forbidden.search(name)
            if found is not None:
                raise ConfigurationError(
                    f"{kind} {_shown(name)} holds {found.group()!r} at {found.start()}, "
                    f"which the broker cannot carry{self._because()}"
                )

    def _because(self) -> str:
        return f" ({self.why})" if self.why else ""


def _shown(name: str) -> str:
    """``name`` for an error: a long one cut short, so the message stays readable."""
    return repr(name) if len(name) <= 64 else f"{name[:48]!r}... ({len(name)} characters)"


#: No limit: what the bus's syntax allows, any broker here carries.
NO_LIMITS = TopicLimits()


@dataclass(frozen=True, slots=True)
class TransportSettings:
    """What a bus tells its transport, once, when it starts (:meth:`Transport.bind`).

    :ivar dead_letter_ttl: seconds a dead letter is kept (a :class:`DeadLetterStore`
        drops older ones).
    :ivar dead_letter_maxlen: most dead letters kept, the newest (0: none).
    :ivar codec: how payloads become bytes; ``None`` keeps the transport's own.
    """

    dead_letter_ttl: float = 7 * 24 * 3600
    dead_letter_maxlen: int = 100_000
    codec: Codec | None = None


@runtime_checkable
class Delivery(Protocol):
    """One envelope handed to a consumer, to be settled exactly once (the public protocol).

    asyncbus's transports hand out :class:`BaseDelivery` subclasses, which also carry
    ``error`` (why the body could not be decoded) and, where acks are written behind,
    ``ack_nowait()``.
    """

    envelope: Envelope

    async def ack(self) -> None:
        """Done: the broker forgets it."""

    async def nack(self, *, delay: float | None = None) -> None:
        """Not done: deliver it again (to any consumer of the group) after ``delay`` s."""

    async def reject(
        self,
        reason: str,
        *,
        error: str | None = None,
        stage: str | None = None,
        attempts: int | None = None,
    ) -> None:
        """Give up: move it to the transport's dead-letter store, then forget it.

        ``reject(reason)`` alone is enough; the keywords are the dead letter's details
        (``error``, the ``stage`` that gave up, and ``attempts``, the attempt that
        failed last when the bus retried), which a :class:`DeadLetterStore` keeps. The
        bus passes them to :class:`BaseDelivery` deliveries only, so a delivery written
        to ``reject(self, reason)`` alone still works.
        """


class Transport(AsyncResource, abc.ABC):
    """Base class of every transport; ``async with transport:`` connects and closes.

    Subclasses set :attr:`capabilities` and implement :meth:`publish` and
    :meth:`subscribe`; what more their broker offers they implement as the optional
    protocols of this module (a dead-letter store, routed publishing, backlog...),
    which the bus looks for once, when it binds the transport. Client libraries are
    imported in :meth:`connect`, never at module import, so a missing extra fails
    with a message naming it. Settings are given to the constructor; the bus's own
    (dead-letter limits, codec) come through :meth:`bind`, never by setting
    attributes.

    :param codec: how payloads become bytes (JSON by default, msgspec when installed;
        never pickle).
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Short name used in logs and receipts.
    name: ClassVar[str] = "transport"
    #: True when a bus may skip the transport and keep envelopes in its stages' own
    #: streams (the in-process transport); brokers are always gone through.
    direct: bool = False
    #: True when :meth:`publish` (and ``publish_routed``, when it has it) always
    #: awaits the broker before returning: that wait is then the publishing call's one
    #: yield to the event loop, and the bus does not yield again before sending (a call
    #: that raises instead, e.g. for a payload the codec refuses, gets its yield from
    #: the bus). Left False, the bus yields first (a transport that may return without
    #: awaiting).
    publish_waits: ClassVar[bool] = False

    #: What the broker can carry as a topic or a pattern (none by default); a
    #: transport whose limits depend on its settings sets its own in ``__init__``.
    limits: TopicLimits = NO_LIMITS

    #: When clean-up with the broker gives up (anyio clock), set by :meth:`close_by`.
    close_deadline: float = math.inf

    def __init__(self, *, codec: Codec | None = None) -> None:
        self.codec = codec if codec is not None else default_codec()
        #: The bus's settings, as last bound (defaults until then).
        self.settings = TransportSettings()

    def bind(self, settings: TransportSettings) -> None:
        """Take a bus's settings, before it enters the transport (at each start).

        The one call through which a bus configures its transport: the dead-letter
        limits, the codec (unless ``None``), and a new life (no close deadline yet).
        A transport reads :attr:`settings` when it needs them (a broker-side store
        applies the limits when it is created or listed).
        """
        self.settings = settings
        if settings.codec is not None:
            self.codec = settings.codec
        self.close_deadline = math.inf

    @contextmanager
    def cleanup_scope(self, timeout: float = math.inf) -> Iterator[anyio.CancelScope]:
        """A scope for clean-up with the broker (settling, releasing, writing acks, closing).

        Shielded from cancellation, so clean-up is not skipped when its task is
        cancelled, yet bounded: it ends after ``timeout`` seconds or at
        :attr:`close_deadline`, whichever comes first (check ``cancelled_caught``), so a
        broker that stopped answering never holds a close up for ever.
        """
        deadline = min(anyio.current_time() + timeout, self.close_deadline)
        scope = anyio.CancelScope(shield=True, deadline=deadline)
        cleanups = self.__dict__.setdefault("_cleanups", set())
        cleanups.add(scope)
        try:
            with scope:
                yield scope
        finally:
            cleanups.discard(scope)

    def close_by(self, deadline: float) -> None:
        """Give up every clean-up with the broker at ``deadline`` (anyio clock), running or not.

        The bus calls this when it closes, so that releasing deliveries, writing acks
        and closing connections end within its own deadline even when the broker does
        not answer (what is left unsettled the broker delivers again later).
        """
        self.close_deadline = min(self.close_deadline, deadline)
        for scope in self.__dict__.get("_cleanups", ()):
            scope.deadline = min(scope.deadline, deadline)

    def check_topic(self, topic: str) -> None:
        """Raise :class:`ConfigurationError` when the broker cannot carry ``topic``.

        The bus asks before every publish over the transport; the default applies
        :attr:`limits`. Override it (calling it) for a rule they cannot state.
        """
        self.limits.check_topic(topic)

    def check_pattern(self, pattern: str) -> None:
        """Raise :class:`ConfigurationError` when the broker cannot carry ``pattern``.

        The bus asks in ``subscribe``, before the subscription exists (a running bus
        is left as it was); the default applies :attr:`limits`.
        """
        self.limits.check_pattern(pattern)

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def connect(self) -> None:
        """Open connections (called by ``async with``)."""

    async def aclose(self) -> None:
        """Close connections; runs shielded from cancellation in subclasses."""

    @abc.abstractmethod
    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Hand ``envelopes`` (all on ``topic``) to the broker; return once it confirmed.

        The broker routes each one to every (pattern, group) subscribed to a matching
        pattern; the envelope id travels as the broker's message id. See
        :attr:`publish_waits` for how it counts toward the bus's fairness rule.
        """

    @abc.abstractmethod
    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[Delivery]]:
        """Join consumer ``group`` on ``pattern`` (NATS syntax); yields deliveries.

        The group is created if needed and outlives the subscription; consumers in
        one group share its envelopes. At most ``prefetch`` deliveries are unsettled
        at once. Leaving the context releases what was delivered but not settled.
        """


@runtime_checkable
class RoutedPublisher(Protocol):
    """A transport that tells which groups a publish reached (every process's).

    Its broker knows the groups, so an envelope that matches none anywhere is not
    published but stored as a ``no_subscribers`` dead letter: nothing published is
    silently lost. (Without it the bus publishes and names its own matching stages.)
    """

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`Transport.publish`, telling which groups the envelopes reached.

        :returns: the stage names (``"pattern@group"``, sorted) of the groups reached,
            ``()`` when they reached none (each was dead-lettered), or ``None`` when
            the transport cannot tell this time.
        """


@runtime_checkable
class GroupPublisher(Protocol):
    """A transport that can deliver to one (pattern, group) only (what replay uses).

    (Without it a replay is published to the envelope's topic, reaching every group.)
    """

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Deliver ``envelopes`` to the group (``pattern``, ``group``) and no other."""


@runtime_checkable
class BacklogReader(Protocol):
    """A transport that counts what a group has not settled (``drain()``, metrics,
    health checks ask it; without it the bus counts 0)."""

    async def backlog(self, pattern: str, group: str) -> int:
        """Envelopes of (pattern, group) in the broker not yet settled (delivered or not)."""


@runtime_checkable
class DeadLetterStore(Protocol):
    """A transport whose broker keeps dead letters (``capabilities.replay``).

    Its deliveries' ``reject`` stores the details given; the bus stores there what it
    dead-letters without a delivery, loads the store when it starts (so every process
    sees every dead letter) and removes what it replays or purges. Entries past
    :attr:`TransportSettings.dead_letter_ttl` or beyond
    :attr:`TransportSettings.dead_letter_maxlen` are not listed.
    """

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Store a dead letter the bus recorded without a delivery."""

    async def dead_letters(self) -> list[DeadLetter]:
        """Every dead letter kept, oldest first (after dropping expired ones)."""

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Forget the dead letters of these envelope ids (no ids: none)."""


@dataclass(frozen=True, slots=True)
class DeadLetterChange:
    """What changed in a broker's dead-letter store (:meth:`SharedDeadLetters.watch_dead_letters`).

    :ivar added: entries stored, by any process.
    :ivar removed: the keys (:func:`asyncbus._dead_letters.dead_letter_key`: envelope id
        and timestamp, stage, reason) of entries removed, by any process.
    :ivar stale: changes may have been missed (the connection dropped, a gap): read the
        whole store again.
    """

    added: tuple[DeadLetter, ...] = ()
    removed: tuple[DeadLetterKey, ...] = ()
    stale: bool = False


@runtime_checkable
class SharedDeadLetters(Protocol):
    """A :class:`DeadLetterStore` that is one list for every process using the broker.

    Its removal is the claim that makes a replay happen once: of calls that would remove
    one entry at the same time, exactly one gets it. And it tells every process what is
    added and removed, so each one's ``bus.dead_letters`` lists every process's entries.
    Its ``remove_dead_letters`` is :meth:`take_dead_letters` without the answer.
    """

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Remove the dead letters of these envelope ids; return the ones this call
        removed, oldest first (none for an id another call took first, or never kept)."""

    async def clear_dead_letters(self) -> None:
        """Remove every dead letter kept (every watcher is told to read the store again)."""

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Keep ``entries`` again: taken for a replay that could not be sent (every
        watcher is told to read the store again)."""

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every change to the store made after the context was entered, by any process,
        in the order the broker made them; a change with ``stale`` set whenever some may
        have been missed. The iterator raises :class:`~asyncbus.TransportError` when the
        broker is lost (enter again, then read the store)."""


@runtime_checkable
class DedupStoreProvider(Protocol):
    """A transport whose broker can keep ``deduplicate()``'s store, shared by every
    process using it (without it each process remembers only its own handlings)."""

    def dedup_store(self, window: float) -> DedupStore:
        """The store; ``window`` is the seconds a handled envelope is remembered."""


@runtime_checkable
class RateStoreProvider(Protocol):
    """A transport whose broker can keep ``RateLimit``'s turns, shared by every process
    using it (without it each process limits only what it handles)."""

    def rate_store(self) -> RateStore:
        """The store (see :mod:`asyncbus._rates`)."""


@runtime_checkable
class LeaseStoreProvider(Protocol):
    """A transport whose broker can keep ``max_in_flight``'s slots as leases, shared by
    every process using it (without it each process bounds only its own handlers)."""

    def lease_store(self) -> LeaseStore:
        """The store (see :mod:`asyncbus._flights`)."""


@runtime_checkable
class PartitionLeasesProvider(Protocol):
    """A transport that keeps the partitions of an ordered group leased to its replicas
    in a way of its own (RabbitMQ: exclusive queues); a transport without it whose
    :class:`LeaseStoreProvider` store counts its leases keeps them as leases there."""

    def partition_leases(self) -> PartitionLeases:
        """The leases (see :mod:`asyncbus._partitions`)."""


@runtime_checkable
class TickClaimsProvider(Protocol):
    """A transport whose broker cannot keep a shared ``deduplicate()`` store but can
    still make one replica publish each tick of a periodic schedule (RabbitMQ: a lock
    per schedule that goes with its holder's connection)."""

    def tick_claims(self) -> DedupStore:
        """A store for the periodic runner's keys only (``_asyncbus.periodic.*``)."""


@runtime_checkable
class AcksWrittenBehind(Protocol):
    """A transport whose deliveries' ``ack_nowait()`` only queue the ack for a writer
    (:attr:`BaseDelivery.acks_behind`), so the bus acks without a shielded await per
    envelope; acks it could not write before closing it reports here."""

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """``(stage name, envelope id)`` of each queued ack the transport closed without
        writing, or lost with its connection (the broker delivers those again); each
        is reported once."""


@runtime_checkable
class SubscriptionControl(Protocol):
    """What a transport's ``subscribe`` yields, when the bus can steer it while it runs.

    The bus sizes its prefetch to what a stage should hold (a controlled stage's window:
    ``min(capacity, limit)`` queued plus ``limit`` in its consumers, as the limit moves),
    and handles a *suspect* (a delivery with :attr:`BaseDelivery.redeliveries`: a
    consumer died or hung with it) alone: prefetch 1, every other delivery settled and
    written first, so that if it kills this process too the broker counts that death
    for it and for nothing else. Without it, the prefetch given to ``subscribe`` stays
    and suspects are handled as any delivery.
    """

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` unsettled deliveries from now on.

        Deliveries received and not yet handed out beyond that are given back to the
        broker at once, unhandled and not counted as a delivery (as when a subscription
        ends); nothing more is received while ``prefetch`` or more are held. What was
        handed out stays until it is settled.
        """

    async def flush(self) -> None:
        """Return once the broker has every settle of this subscription made so far
        (acks written behind included).

        :raises Exception: when the broker did not take them (what its client raised;
            the settles stay queued, to be written again).
        """


@runtime_checkable
class KeepAlive(Protocol):
    """A transport that can keep a held delivery from other consumers however long it
    is held (a long handler, a retry waiting): only a dead process loses its
    deliveries. ``keep_alive`` is a constructor setting, read by each ``subscribe``.
    """

    keep_alive: bool
