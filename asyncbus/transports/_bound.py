"""A transport as a bus uses it: its optional protocols looked up once, with fallbacks.

The bus never asks a transport what it is on the hot path, nor with ``getattr``: it
makes one :class:`BoundTransport` per transport (``isinstance`` against each
optional protocol of :mod:`.base`) and calls it. For what the transport lacks the
fallback is the bus's: publish and name its own stages, publish to the topic, count
0, keep dead letters in the process only, no acks written behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .base import (
    AcksWrittenBehind,
    BacklogReader,
    DeadLetterStore,
    GroupPublisher,
    RoutedPublisher,
    SharedDeadLetters,
    Transport,
)

__all__ = ["BoundTransport"]


@dataclass(frozen=True, slots=True, eq=False)
class BoundTransport:
    """A transport and the optional protocols it implements (``None``: it does not).

    :ivar transport: the transport (its core: publish, subscribe, close_by...).
    :ivar routed: its :class:`~.base.RoutedPublisher` side.
    :ivar to_group: its :class:`~.base.GroupPublisher` side.
    :ivar counter: its :class:`~.base.BacklogReader` side.
    :ivar store: its :class:`~.base.DeadLetterStore` side.
    :ivar shared: its :class:`~.base.SharedDeadLetters` side (a store every process shares).
    :ivar acks: its :class:`~.base.AcksWrittenBehind` side.
    """

    transport: Transport
    routed: RoutedPublisher | None
    to_group: GroupPublisher | None
    counter: BacklogReader | None
    store: DeadLetterStore | None
    acks: AcksWrittenBehind | None
    shared: SharedDeadLetters | None = None

    @classmethod
    def of(cls, transport: Transport) -> BoundTransport:
        """Look up, once, which optional protocols ``transport`` implements."""
        return cls(
            transport,
            transport if isinstance(transport, RoutedPublisher) else None,
            transport if isinstance(transport, GroupPublisher) else None,
            transport if isinstance(transport, BacklogReader) else None,
            transport if isinstance(transport, DeadLetterStore) else None,
            transport if isinstance(transport, AcksWrittenBehind) else None,
            transport
            if isinstance(transport, SharedDeadLetters) and isinstance(transport, DeadLetterStore)
            else None,
        )

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """The groups reached (:class:`~.base.RoutedPublisher`), or ``None`` after a
        plain publish when the transport cannot tell."""
        if self.routed is not None:
            return await self.routed.publish_routed(topic, envelopes)
        await self.transport.publish(topic, envelopes)
        return None

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """To one group (:class:`~.base.GroupPublisher`), else to each envelope's topic."""
        if self.to_group is not None:
            await self.to_group.publish_to_group(pattern, group, envelopes)
            return
        for envelope in envelopes:
            await self.transport.publish(envelope.topic, [envelope])

    async def backlog(self, pattern: str, group: str) -> int:
        """What (pattern, group) has not settled in the broker (0 when it cannot tell)."""
        return 0 if self.counter is None else await self.counter.backlog(pattern, group)

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Store ``entry`` in the broker, if it keeps dead letters."""
        if self.store is not None:
            await self.store.add_dead_letter(entry)

    async def dead_letters(self) -> list[DeadLetter]:
        """The broker's dead letters (none when it keeps none)."""
        return [] if self.store is None else await self.store.dead_letters()

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Forget these ids in the broker, if it keeps dead letters."""
        if self.store is not None:
            await self.store.remove_dead_letters(ids)

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """Acks written behind that never reached the broker (none when acks are awaited)."""
        return [] if self.acks is None else self.acks.unsettled_acks()
