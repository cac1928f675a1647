"""The mode of a bus over a broker, which holds envelopes between publish and handle."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import cast

import anyio
import anyio.lowlevel

from .._cluster import Heartbeats
from .._dead_letters import DEADLETTER_TOPIC, DeadLetter, DeadLetterQueue, DeadLetterReason
from .._dedup import DedupStore, MemoryDedupStore
from .._delivering import Tap, pump
from .._envelope import Envelope, Receipt, make_receipt, make_receipts
from .._exceptions import BusClosedError, ConfigurationError, EncodeError
from .._groups import (
    GroupInfo,
    delete_group,
    group_order,
    list_groups,
    local_groups,
    no_admin,
)
from .._leases import LeaseCounter, LeaseStore, PartitionLeases
from .._partitions import (
    LeasedPartitions,
    Partitions,
    fold_partitions,
    partition_group,
    partition_of,
)
from .._rates import RateStore
from .._routing import compile_pattern
from .._stage import Stage
from .._time.broker import CLAIMS_WINDOW, BrokerKeeper
from .._time.due import BusTime
from .._time.held import Fire, Keeper, LocalKeeper
from ..transports._bound import BoundTransport
from ..transports._codec import Codec, encode_payload
from ..transports.base import (
    DedupStoreProvider,
    GroupAdmin,
    LeaseStoreProvider,
    PartitionLeasesProvider,
    RateStoreProvider,
    TickClaimsProvider,
    Transport,
    TransportSettings,
)
from .dead_letters import BrokerStore, watch
from .local import LocalMode
from .mode import CLOSE_GRACE, INBOX, Progress
from .stale_groups import StaleGroups

__all__ = ["BrokerMode", "over_broker", "split_stage_name"]

dead_letter_logger = logging.getLogger("asyncbus.dead_letters")
groups_logger = logging.getLogger("asyncbus.groups")
flights_logger = logging.getLogger("asyncbus.flights")

#: Seconds between two readings of the broker's groups while the bus runs (what a plain
#: ``bus.groups()`` shows is at most this old, besides this process's own stages).
GROUPS_READ_INTERVAL = 5.0


def _batch_encode_error(
    topic: str, envelopes: list[Envelope], error: EncodeError, codec: Codec | None
) -> EncodeError:
    """``error`` of a batch's write, saying which payload of the batch could not be encoded
    (looked for only now, on the error's path)."""
    where = f"publish_many({topic!r}), a batch of {len(envelopes)}"
    for position, envelope in enumerate(envelopes):
        if codec is None:
            break
        try:
            encode_payload(codec, envelope.payload)
        except Exception:  # a codec raises what its library raises
            where += f": the payload at position {position} (envelope {envelope.id})"
            break
    return EncodeError(f"{where}: {error}")


class BrokerMode:
    """A broker holds envelopes between publish and handle, for every process.

    A pump per stage feeds it from the broker; publishes go to the broker, which routes
    them to every group of every process. ``$deadletter`` announcements stay in this
    process (through the local mode it keeps).
    """

    admits_inline = False

    def __init__(
        self,
        transport: Transport,
        local: LocalMode,
        codec: object | None,
        stale_group_after: float | None = None,
    ) -> None:
        self.transport = transport
        #: Seconds without a consumer after which a group reached is warned of.
        self.stale_group_after = stale_group_after
        #: The watcher of stale groups while the bus runs (``None``: not watched).
        self.stale_groups: StaleGroups | None = None
        #: The latest reading of the broker's groups (the plain ``bus.groups()``).
        self.group_reading: list[GroupInfo] = []
        #: The transport and the optional protocols it implements, looked up once.
        self.port = BoundTransport.of(transport)
        self.codec = cast("Codec | None", codec)
        self.local = local
        self.host = local.host
        self.system = transport.name
        #: Pumps started that have not run yet (see :meth:`check_before_send`), and
        #: whether a stop was asked for (a pump cancelled before it ran never counts down).
        self.pumps_starting = 0
        self.stopping = False

    async def open(self, stack: AsyncExitStack, dead_letters: DeadLetterQueue) -> None:
        """Enter the transport for this life of the bus and restore its dead letters."""
        self.pumps_starting = 0
        self.stopping = False
        broker = self.transport
        # The bus's settings, given once, before entering (a new life: no deadline yet).
        broker.bind(
            TransportSettings(
                dead_letter_ttl=dead_letters.ttl,
                dead_letter_maxlen=dead_letters.maxlen,
                codec=self.codec,
            )
        )
        await stack.enter_async_context(broker)
        self.stale_groups = None
        self.group_reading = []
        port = self.port
        if port.shared is None:
            # A store of this process's making (or none): loaded once, kept here.
            dead_letters.share(port.dead_letters if port.store is not None else None, None)
            for entry in await port.dead_letters():
                dead_letters.restore(entry)
            await self._watch_groups(stack)
            return
        # One list for every process: this queue is its view, read now (``start``
        # waits for it) and kept up to date from the broker's changes until the close.
        dead_letters.share(port.dead_letters, BrokerStore(port.shared, port))
        await dead_letters.refresh()  # the first read: its failure fails the start
        watchers = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(watchers.cancel_scope.cancel)  # (callbacks run first: LIFO)
        await watchers.start(watch, port.shared, dead_letters)
        await self._watch_groups(stack)

    async def _watch_groups(self, stack: AsyncExitStack) -> None:
        """Watch the broker's groups for stale ones until the close (see
        :mod:`.stale_groups`). Last in ``open``: a start that fails before it must not
        raise through the watcher's task group (as an exception group)."""
        broker = self.transport
        if not isinstance(broker, GroupAdmin):
            return
        if self.stale_group_after is not None:
            self.stale_groups = StaleGroups(broker, self.stale_group_after, self.local.stages)
        # The first reading, for a plain ``bus.groups()`` right after the start (bounded:
        # a broker slow to list its groups does not hold the start up).
        with anyio.move_on_after(GROUPS_READ_INTERVAL):
            await self._take_reading(broker)
        watching = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(watching.cancel_scope.cancel)  # (callbacks run first: LIFO)
        watching.start_soon(self._read_groups, broker)

    def close_by(self, deadline: float) -> float:
        """Keep the end of the deadline for closing with the broker.

        Settling, releasing deliveries and closing connections get it however silent
        the broker is: what it could not settle it delivers again later. (``close_by``
        only ever brings the transport's deadline forward.)
        """
        self.stopping = True
        now = anyio.current_time()
        if deadline == -math.inf:  # cancel at once: a short grace to close
            self.transport.close_by(now + CLOSE_GRACE)
            return deadline
        self.transport.close_by(max(deadline, now + CLOSE_GRACE / 4))
        if deadline < math.inf:
            deadline -= min(CLOSE_GRACE, max(deadline - now, 0.0) / 4)
        return deadline

    def publish_yield(
        self, yield_now: Callable[[], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """:meth:`check_before_send` when the transport's publish always waits for the
        broker (``publish_waits``): that wait is the publish's one yield (a second pass
        of the event loop per publish cost a RabbitMQ publisher about a fifth of its CPU
        per message). Otherwise the backend's yield, first, as in memory."""
        if self.transport.publish_waits:
            return self.check_before_send
        return yield_now

    async def check_before_send(self) -> None:
        """Before a publish over a transport that waits: a cancellation check, or, while
        a pump started by ``subscribe`` on the running bus has not run yet, the backend's
        yield until it has (its subscription begins before the publish goes out, so the
        broker knows the group; trio runs ready tasks in any order, hence the loop).

        A publish that ends without reaching the broker yields too: see
        :meth:`send_none` and ``Bus.publish``.
        """
        if not self.pumps_starting:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return
        await self.host.yield_now()
        while self.pumps_starting and not self.stopping:
            await self.host.yield_now()

    def lost_acks(self) -> Iterable[tuple[str, str]]:
        """Acks written behind that the broker never got."""
        return self.port.unsettled_acks()

    async def backlog(self, stages: Iterable[Stage]) -> int:
        """What the broker still holds for the stages it feeds."""
        total = 0
        for stage in list(stages):
            if not over_broker(stage):
                continue
            partitions = stage.partitioned
            groups = [stage.group] if partitions is None else partitions.groups()
            for group in groups:
                total += await self.port.backlog(stage.pattern, group)
        return total

    def start(self, stage: Stage) -> None:
        """Start the stage's pump (once), unless it is a ``$deadletter`` stage; an
        ordered stage split into partitions, the keeper of its partitions."""
        if over_broker(stage) and not stage.pumping:
            stage.pumping = True
            stage.subscribed = anyio.Event()
            self.pumps_starting += 1
            if stage.partitioned is not None:
                name = f"asyncbus partitions {stage.name}"
                self.host.start_soon(self._serve_partitions, stage, name=name)
            else:
                self.host.start_soon(self._pump, stage, name=f"asyncbus pump {stage.name}")

    def check_pattern(self, pattern: str) -> None:
        """The transport's limits (``$deadletter`` stays in this process)."""
        if pattern != DEADLETTER_TOPIC:
            self.transport.check_pattern(pattern)

    def partitions(self, stage: Stage, count: int | None) -> Partitions | None:
        """An ordered stage's ``count`` partitions, each served by one replica (see
        :mod:`asyncbus._partitions`); ``None`` when not split."""
        return None if count is None else Partitions(stage, count)

    def check_partitions(self, pattern: str, partitions: int | None) -> None:
        """Partitions are leases in the broker: refused over one that keeps none."""
        if partitions is None:
            return
        if self._partition_leases() is not None:
            return
        transport = self.transport
        raise ConfigurationError(
            f"subscribe({pattern!r}): partitions={partitions} over "
            f"{type(transport).__name__}: each partition is served by the replica holding its "
            "lease, and this transport keeps no leases (Redis, NATS, PostgreSQL and RabbitMQ "
            "do); without partitions, ordering='key' keeps each key's order among what one "
            "process receives (run one consumer process for the group to keep it for the group)"
        )

    def check_topic(self, topic: str) -> None:
        """The transport's limits (``$deadletter`` stays in this process)."""
        if topic != DEADLETTER_TOPIC:
            self.transport.check_topic(topic)

    async def _pump(self, stage: Stage) -> None:
        self.pumps_starting -= 1  # runs on: its subscription begins before its first await
        await pump(stage, self.transport, self.host)

    def _partition_leases(self) -> PartitionLeases | None:
        """Where the transport keeps partitions' leases (``None``: nowhere)."""
        transport = self.transport
        if isinstance(transport, PartitionLeasesProvider):
            return transport.partition_leases()
        if isinstance(transport, LeaseStoreProvider):
            store = transport.lease_store()
            if isinstance(store, LeaseCounter):
                return LeasedPartitions(store)
        return None

    async def _serve_partitions(self, stage: Stage) -> None:
        """Keep ``stage``'s share of its partitions, each fed by a pump of its own."""
        self.pumps_starting -= 1
        partitions = stage.partitioned
        assert partitions is not None
        transport = self.transport
        store = self._partition_leases()
        assert store is not None  # (checked at subscribe)

        async def serve(index: int, group: str, tap: Tap) -> None:
            accept = partitions.accepts(index)
            await pump(stage, transport, self.host, group=group, accept=accept, tap=tap)

        recorded = [(info.pattern, info.group) for info in self.group_reading]
        ack_timeout = getattr(transport, "ack_timeout", 0.0)
        settle_wait = float(ack_timeout) if isinstance(ack_timeout, int | float) else 0.0
        # (NATS: a subscription's open pull request outlives it for as long.)
        linger = getattr(transport, "pull_expires", 0.0)
        linger = float(linger) if isinstance(linger, int | float) else 0.0
        try:
            await partitions.run(
                store,
                serve,
                settle_wait,
                recorded,
                stage.subscribed,
                linger,
                transport.cleanup_scope,
            )
        except ConfigurationError as error:
            self.host.refused(stage, error)

    def check_nowait(self) -> None:
        """A broker's confirmation is always waited for."""
        raise anyio.WouldBlock(
            f"publish_nowait cannot wait for {self.transport.name}'s confirmation: "
            "use `await bus.publish(...)` or publish_threadsafe"
        )

    async def send(
        self, envelope: Envelope, timeout: float | None, progress: Progress | None = None
    ) -> Receipt:
        """Publish ``envelope`` to the broker (``$deadletter`` stays in this process).

        The broker routes it to every group of every process and tells which groups it
        knows were reached; with none anywhere it stored a ``no_subscribers`` dead letter.
        """
        local = self.local
        if envelope.topic == DEADLETTER_TOPIC:
            if local.observers:
                local.observe(envelope)
            # No broker round trip to be the publish's one yield (see ``publish_yield``).
            await self.host.yield_now()
            return await local.deliver(envelope, timeout, progress)
        broker = self.transport
        broker.check_topic(envelope.topic)  # refused at the door: nothing observed
        if local.observers:
            local.observe(envelope)
        if envelope.topic.startswith(INBOX):
            # A reply whose requester is gone is dropped, as in memory.
            await broker.publish(envelope.topic, [envelope])
            return Receipt(envelope.id)
        routed = self.port.routed
        if routed is not None:  # straight to it: no extra frame on the hot path
            reached = await routed.publish_routed(envelope.topic, [envelope])
        else:
            reached = await self.port.publish_routed(envelope.topic, [envelope])
        if reached is None:  # the transport cannot tell: name this bus's matching stages
            reached = local.router.names(envelope.topic)
        elif not reached:
            self.host.dead_letter(
                envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0, stored=True
            )
        elif (stale := self.stale_groups) is not None and stale.stale:
            stale.reached(envelope.topic, reached)
        return make_receipt(envelope.id, fold_partitions(reached))

    async def send_many(
        self, envelopes: Sequence[Envelope], timeout: float | None
    ) -> list[Receipt]:
        """Publish ``envelopes`` to the broker in one call (see :meth:`send`).

        The transport writes them pipelined and returns once the broker has them all;
        ``$deadletter`` stays in this process. ``timeout`` bounds nothing here, as for
        :meth:`send`.
        """
        local = self.local
        topic = envelopes[0].topic
        if topic == DEADLETTER_TOPIC:
            await self.host.yield_now()  # no broker round trip to be the call's yield
            return await local.send_many(envelopes, timeout)
        self.transport.check_topic(topic)
        if local.observers:
            for envelope in envelopes:
                local.observe(envelope)
        listed = list(envelopes)
        if topic.startswith(INBOX):
            await self.transport.publish(topic, listed)
            return [Receipt(envelope.id) for envelope in listed]
        routed = self.port.routed
        try:
            if routed is not None:
                reached = await routed.publish_routed(topic, listed)
            else:
                reached = await self.port.publish_routed(topic, listed)
        except EncodeError as error:
            raise _batch_encode_error(
                topic, listed, error, getattr(self.transport, "codec", None)
            ) from error
        if reached is None:  # the transport cannot tell: name this bus's matching stages
            reached = local.router.names(topic)
        elif not reached:
            for envelope in listed:
                self.host.dead_letter(
                    envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0, stored=True
                )
        elif (stale := self.stale_groups) is not None and stale.stale:
            stale.reached(topic, reached)
        return make_receipts(listed, fold_partitions(reached))

    async def send_none(self) -> list[Receipt]:
        """A ``publish_many`` of nothing: no broker round trip to be its one yield."""
        if self.transport.publish_waits:
            await self.host.yield_now()
        return []

    def send_now(self, envelope: Envelope) -> Receipt:
        """Never: see :meth:`check_nowait`."""
        self.check_nowait()
        raise AssertionError("unreachable")  # pragma: no cover

    def store(self, entry: DeadLetter) -> None:
        """Store ``entry`` in the broker, in the background."""
        self.host.start_background(self._store, entry)

    async def _store(self, entry: DeadLetter) -> None:
        try:
            with self.transport.cleanup_scope():
                await self.port.add_dead_letter(entry)
        except Exception:
            dead_letter_logger.warning(
                "could not store dead letter %s", entry.envelope.id, exc_info=True
            )

    def forget(self, ids: Sequence[str], everything: bool = False) -> None:
        """Remove the stored copies of ``ids`` (of every entry when ``everything``: in a
        store every process shares, theirs too), in the background."""
        if ids or everything:
            self.host.start_background(self._forget, list(ids), everything)

    async def _forget(self, ids: list[str], everything: bool) -> None:
        shared = self.port.shared
        try:
            with self.transport.cleanup_scope():
                if shared is not None and everything:
                    await shared.clear_dead_letters()
                elif ids:
                    await self.port.remove_dead_letters(ids)
        except Exception:
            dead_letter_logger.warning(
                "could not remove dead letters %s", "(all)" if everything else ids, exc_info=True
            )

    async def replay(self, entry: DeadLetter, envelope: Envelope) -> Receipt:
        """To the group that dead-lettered it, in whichever process asks.

        A dashboard or a script may replay: the group named in the entry alone gets the
        replay, never the groups that succeeded. Without a stage, to every group of the
        topic; with none yet, the broker keeps it as a ``no_subscribers`` dead letter.
        """
        broker = self.port
        stage = self.local.stages.get(entry.stage) if entry.stage else None
        self.local.observe(envelope)
        target = (
            (stage.pattern, stage.group)
            if stage is not None and over_broker(stage)
            else split_stage_name(entry.stage, envelope.topic)
        )
        if stage is not None and target is not None and stage.partitioned is not None:
            count = stage.partitioned.count  # to the group of the envelope's partition
            target = (target[0], partition_group(target[1], partition_of(envelope, count), count))
        claimed = broker.shared is not None  # the queue took it out of the store
        with anyio.CancelScope(shield=True):
            if not claimed:
                # Forget the stored entry first: the replay may die again at once, and
                # its new dead letter (same id) must not be the one removed.
                await broker.remove_dead_letters([envelope.id])
            reached: tuple[str, ...] | None = (entry.stage,) if entry.stage else ()
            try:
                if target is not None:
                    await broker.publish_to_group(*target, [envelope])
                else:
                    reached = await broker.publish_routed(envelope.topic, [envelope])
            except BaseException:  # deliberate: whatever stopped the re-send, keep it
                if not claimed:  # (a claimed one the queue puts back)
                    await broker.add_dead_letter(entry)  # not re-sent: keep it stored
                raise
        if reached == () and target is None:
            self.host.dead_letter(
                envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0, stored=True
            )
        return make_receipt(envelope.id, reached or ())

    def replies_elsewhere(self, reply_to: str) -> bool:
        """Whether ``reply_to`` is a request inbox (of this or another process)."""
        return reply_to.startswith(INBOX)

    async def reply_address(self, request_id: str, inbox: Callable[[], Awaitable[str]]) -> str:
        """A topic under this bus's inbox, subscribed (and waited for) on first use."""
        return f"{await inbox()}.{request_id}"

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, if it keeps one."""
        if not isinstance(self.transport, DedupStoreProvider):
            return None
        return self.transport.dedup_store(window)

    def rate_store(self) -> RateStore | None:
        """The broker's shared rate-limit turns, if it keeps them."""
        transport = self.transport
        return transport.rate_store() if isinstance(transport, RateStoreProvider) else None

    def lease_store(self) -> LeaseStore | None:
        """The broker's shared ``max_in_flight`` slots, if it keeps them."""
        transport = self.transport
        if isinstance(transport, LeaseStoreProvider):
            return transport.lease_store()
        flights_logger.warning(
            "max_in_flight over %s: the broker keeps no slots, so each process bounds its "
            "own handlers (the group may run that many in every replica)",
            type(transport).__name__,
        )
        return None

    def time_keeper(self, clock: BusTime, fire: Fire) -> Keeper:
        """The broker holds scheduled envelopes (see :mod:`asyncbus._time.broker`) when
        it keeps what it is given (``capabilities.durable``); over a transport that does
        not, this process holds them, as in memory, and abandons them at the close."""
        if not self.transport.capabilities.durable:
            return LocalKeeper(clock, fire)
        store = self.dedup_store(CLAIMS_WINDOW) or MemoryDedupStore()
        return BrokerKeeper(clock, fire, self.port, self.transport, store)

    def claim_store(self) -> tuple[DedupStore, bool]:
        """Where periodic ticks are claimed: the broker's shared store (``deduplicate()``'s),
        else its tick claims (RabbitMQ: one replica leads each schedule), else this
        process's own."""
        store = self.dedup_store(CLAIMS_WINDOW)
        if store is not None:
            return store, True
        if isinstance(self.transport, TickClaimsProvider):
            return self.transport.tick_claims(), True
        return MemoryDedupStore(), False

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """The transport's shielded scope, bounded by its close deadline."""
        return self.transport.cleanup_scope()

    def _admin(self, running: bool) -> GroupAdmin:
        transport = self.transport
        if not isinstance(transport, GroupAdmin):
            raise no_admin(transport.name)
        if not running:
            raise BusClosedError("the bus is not running: use `async with bus:` first")
        return transport

    def heartbeats(self) -> Heartbeats | None:
        """The transport, if it keeps heartbeats (Redis, NATS, PostgreSQL)."""
        transport = self.transport
        return transport if isinstance(transport, Heartbeats) else None

    def groups_now(self, running: bool) -> list[GroupInfo]:
        """Every process's groups as the latest reading of the broker had them, with
        this bus's stages that the reading predates added (their figures here)."""
        self._admin(running)
        stages = self.local.stages
        known = list_groups(self.group_reading, stages)
        listed = {info.name for info in known}
        added = local_groups(
            stage.statistics()
            for name, stage in list(stages.items())
            if name not in listed and over_broker(stage) and not stage.group.startswith(INBOX)
        )
        return sorted([*known, *added], key=group_order)

    async def groups(self, running: bool) -> list[GroupInfo]:
        """Every process's groups, as the broker has them now; ``local`` for this bus's."""
        self.group_reading = reading = await self._admin(running).groups()
        return list_groups(reading, self.local.stages)

    async def delete_group(self, pattern: str, group: str, force: bool, running: bool) -> bool:
        """Delete the group in the broker (see ``Bus.delete_group``)."""
        mine = f"{pattern}@{group}" in self.local.stages
        deleted = await delete_group(self._admin(running), pattern, group, force=force, mine=mine)
        self.group_reading = [
            info for info in self.group_reading if (info.pattern, info.group) != (pattern, group)
        ]
        return deleted

    async def _read_groups(self, admin: GroupAdmin) -> None:
        """Read the broker's groups every :data:`GROUPS_READ_INTERVAL` (or the stale
        watch's interval, if shorter) until cancelled: the plain ``bus.groups()``'s
        latest reading, and the stale watch's readings. A failure is logged only."""
        stale = self.stale_groups
        interval = (
            GROUPS_READ_INTERVAL if stale is None else min(GROUPS_READ_INTERVAL, stale.interval)
        )
        while True:
            await anyio.sleep(interval)
            await self._take_reading(admin)

    async def _take_reading(self, admin: GroupAdmin) -> None:
        """One reading of the broker's groups (a failure is logged and keeps the last)."""
        try:
            reading = await admin.groups()
        except Exception as error:  # the next round tries again
            groups_logger.debug("reading the groups failed: %s", error)
            return
        self.group_reading = reading
        if (stale := self.stale_groups) is not None:
            stale.update(reading, time.time())


def over_broker(stage: Stage) -> bool:
    """Whether a broker feeds ``stage``: ``$deadletter`` stays in this process."""
    return stage.pattern != DEADLETTER_TOPIC


def split_stage_name(name: str | None, topic: str) -> tuple[str, str] | None:
    """The (pattern, group) of stage ``name`` (``"{pattern}@{group}"``) that ``topic`` reached.

    Either part may hold ``@``: the split kept is the first whose pattern is valid and
    matches ``topic`` (``None`` when there is none, or no name).
    """
    if not name:
        return None
    at = name.find("@")
    while at > 0:
        pattern, group = name[:at], name[at + 1 :]
        if group:
            try:
                if compile_pattern(pattern)(topic):
                    return pattern, group
            except ConfigurationError:
                pass
        at = name.find("@", at + 1)
    return None
