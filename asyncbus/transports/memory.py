"""The in-process transport: the bus's default, and the reference for the others."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import ClassVar

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from .._dead_letters import DeadLetter, dead_letter_key
from .._envelope import Envelope
from .._exceptions import TransportError
from .._groups import GroupInfo
from .._routing import compile_pattern, validate_topic
from ._codec import Codec
from ._kit import TaskOwner
from ._kit.routes import is_inbox, unrouted_entry
from .base import BaseDelivery, Capabilities, DeadLetterChange, Delivery, Transport

__all__ = ["MemoryTransport"]


class _Group:
    """One (pattern, group): its ready envelopes and the consumers waiting for one."""

    def __init__(self, pattern: str) -> None:
        self.matches = compile_pattern(pattern)
        self.ready: deque[Envelope] = deque()
        self.waiters: deque[anyio.Event] = deque()
        #: Delivered to some consumer and not settled yet.
        self.unsettled = 0
        #: Subscriptions reading it now.
        self.consumers = 0

    def put(self, envelope: Envelope, *, front: bool = False) -> None:
        if front:
            self.ready.appendleft(envelope)
        else:
            self.ready.append(envelope)
        if self.waiters:
            self.waiters.popleft().set()


#: Why a delivery its consumer gave back cannot be settled.
_RELEASED = "was released when its subscription ended"


class _MemoryDelivery(BaseDelivery):
    """A delivery from :class:`MemoryTransport`."""

    __slots__ = ("_consumer", "_transport")

    def __init__(self, transport: MemoryTransport, consumer: _Consumer, envelope: Envelope):
        super().__init__(envelope)
        self._transport = transport
        self._consumer = consumer

    def _settled(self) -> None:
        self._consumer.unsettled.pop(id(self), None)
        self._consumer.group.unsettled -= 1
        self._consumer.room.set()

    async def _ack(self) -> None:
        """Forget the envelope."""

    async def _nack(self, delay: float | None) -> None:
        """Deliver it again (attempt + 1) to the group after ``delay`` seconds."""
        again = self.envelope.evolve(attempt=self.envelope.attempt + 1)
        self._transport._redeliver(self._consumer.group, again, delay)

    async def _reject(self, entry: DeadLetter) -> None:
        """Move it to the transport's dead letters."""
        self._transport._keep_dead([entry])


class _Consumer:
    def __init__(self, group: _Group) -> None:
        self.group = group
        self.unsettled: dict[int, _MemoryDelivery] = {}
        self.room = anyio.Event()


class MemoryTransport(Transport):
    """Envelopes in this process's memory, no serialisation, no broker.

    A :class:`~asyncbus.Bus` given this transport (or none) keeps envelopes directly
    in each stage's bounded anyio stream, so the interface costs nothing. Used on
    its own, it is a small in-process broker with the same semantics as the others:
    consumer groups, at-least-once delivery, delayed ``nack``, dead letters. It is
    entered with ``async with`` (delayed redeliveries run in its task group).
    """

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True, dedup=False, per_message_ttl=False, replay=True, durable=False
    )
    name: ClassVar[str] = "memory"
    #: Every publish checkpoints (the call's one yield), as a broker's would.
    publish_waits: ClassVar[bool] = True

    def __init__(self, *, codec: Codec | None = None, direct: bool = True) -> None:
        """
        :param direct: let a bus keep envelopes in its stages (the fast default);
            ``False`` makes the bus go through this transport like through a broker,
            which tests the broker path without a server.
        """
        super().__init__(codec=codec)
        self.direct = direct
        self._groups: dict[tuple[str, str], _Group] = {}
        self._dead: list[DeadLetter] = []
        #: Where each watcher of the dead letters is told what changed.
        self._watchers: set[MemoryObjectSendStream[DeadLetterChange]] = set()
        self._tasks = TaskOwner("MemoryTransport")

    async def connect(self) -> None:
        """Start the task group that runs delayed redeliveries."""
        await self._tasks.open()

    async def aclose(self) -> None:
        """Cancel pending delayed redeliveries."""
        await self._tasks.aclose()

    def _redeliver(self, group: _Group, envelope: Envelope, delay: float | None) -> None:
        if not delay:
            group.put(envelope)
            return
        if not self._tasks.running:
            raise TransportError("MemoryTransport must be entered (async with) for nack(delay=)")

        async def later() -> None:
            await anyio.sleep(delay)
            group.put(envelope)

        self._tasks.start_soon(later)

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Hand each envelope to every group whose pattern matches ``topic``."""
        validate_topic(topic)
        await anyio.lowlevel.checkpoint()
        groups = [group for group in self._groups.values() if group.matches(topic)]
        for envelope in envelopes:
            for group in groups:
                group.put(envelope)

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish`; with no group for ``topic``, keep ``no_subscribers`` dead letters.

        :returns: the stage names of the groups reached, sorted (as the brokers' are).
        """
        validate_topic(topic)
        names = tuple(
            sorted(
                f"{pattern}@{group}"
                for (pattern, group), target in self._groups.items()
                if target.matches(topic)
            )
        )
        await self.publish(topic, envelopes)
        if not names:
            self._keep_dead([unrouted_entry(envelope) for envelope in envelopes])
        return names

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Hand the envelopes to one group only."""
        target = self._groups.setdefault((pattern, group), _Group(pattern))
        for envelope in envelopes:
            target.put(envelope)

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[AsyncIterator[Delivery]]:
        """Join ``group`` on ``pattern``; unsettled deliveries go back when it ends."""
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        target = self._groups.setdefault((pattern, group), _Group(pattern))
        consumer = _Consumer(target)

        async def deliveries() -> AsyncIterator[Delivery]:
            while True:
                while len(consumer.unsettled) >= prefetch:
                    consumer.room = anyio.Event()
                    await consumer.room.wait()
                while not target.ready:
                    waiter = anyio.Event()
                    target.waiters.append(waiter)
                    try:
                        await waiter.wait()
                    finally:
                        if waiter in target.waiters:
                            target.waiters.remove(waiter)
                        elif target.ready and target.waiters:
                            target.waiters.popleft().set()
                delivery = _MemoryDelivery(self, consumer, target.ready.popleft())
                consumer.unsettled[id(delivery)] = delivery
                target.unsettled += 1
                await anyio.lowlevel.checkpoint()
                yield delivery

        iterator = deliveries()
        target.consumers += 1
        try:
            yield iterator
        finally:
            target.consumers -= 1
            await iterator.aclose()  # type: ignore[attr-defined]
            # A consumer that leaves gives back what it took but did not settle,
            # oldest first, so another consumer of the group gets it at once.
            for delivery in reversed(list(consumer.unsettled.values())):
                delivery.take_back(_RELEASED)
                target.unsettled -= 1
                # It was delivered once already: the next delivery is the next attempt.
                again = delivery.envelope.evolve(attempt=delivery.envelope.attempt + 1)
                target.put(again, front=True)
            consumer.unsettled.clear()

    async def backlog(self, pattern: str, group: str) -> int:
        """Envelopes of the group not settled: waiting, or delivered and not settled."""
        target = self._groups.get((pattern, group))
        return len(target.ready) + target.unsettled if target is not None else 0

    async def groups(self) -> list[GroupInfo]:
        """Every group made by a subscription or a replay, with its backlog and the
        subscriptions reading it."""
        return [
            GroupInfo(pattern, group, len(target.ready) + target.unsettled, target.consumers)
            for (pattern, group), target in self._groups.items()
            if not is_inbox(group)
        ]

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Forget the group and what it holds (later publishes do not reach it)."""
        await anyio.lowlevel.checkpoint()
        return self._groups.pop((pattern, group), None) is not None

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Keep ``entry``."""
        self._keep_dead([entry])

    def _keep_dead(self, entries: list[DeadLetter]) -> None:
        self._dead.extend(entries)
        self._tell(DeadLetterChange(added=tuple(entries)))

    def _tell(self, change: DeadLetterChange) -> None:
        for watcher in self._watchers:
            watcher.send_nowait(change)

    async def dead_letters(self) -> list[DeadLetter]:
        """The dead letters kept, oldest first, after dropping expired ones."""
        horizon = time.time() - self.settings.dead_letter_ttl
        self._dead = [entry for entry in self._dead if entry.dead_at > horizon]
        del self._dead[: max(0, len(self._dead) - self.settings.dead_letter_maxlen)]
        return list(self._dead)

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Forget the dead letters of these envelope ids."""
        await self.take_dead_letters(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Remove the dead letters of these envelope ids and return them (the claim)."""
        drop = set(ids)
        taken = [entry for entry in self._dead if entry.envelope.id in drop]
        if taken:
            self._dead = [entry for entry in self._dead if entry.envelope.id not in drop]
            self._tell(DeadLetterChange(removed=tuple(map(dead_letter_key, taken))))
        return taken

    async def clear_dead_letters(self) -> None:
        """Forget every dead letter."""
        self._dead.clear()
        self._tell(DeadLetterChange(stale=True))

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Keep ``entries`` again (taken for a replay that failed)."""
        self._dead.extend(entries)
        self._tell(DeadLetterChange(stale=True))

    @asynccontextmanager
    async def watch_dead_letters(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every change to the dead letters from now on."""
        send, receive = anyio.create_memory_object_stream[DeadLetterChange](math.inf)
        self._watchers.add(send)
        try:
            async with receive:
                yield receive
        finally:
            self._watchers.discard(send)
            send.close()
