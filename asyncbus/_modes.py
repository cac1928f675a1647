"""Where a bus sends what it publishes: its own stages, or a broker.

A bus picks its mode once, when it is made: :class:`LocalMode` when envelopes wait in
this process's stages (no transport, or a direct one such as ``MemoryTransport``),
:class:`BrokerMode` when a broker holds them between publish and handle. Everything
the bus does differently over a broker is a method of :class:`Mode`: routing a publish,
replaying a dead letter, storing and forgetting dead letters, answering a request made
elsewhere, the backlog ``drain()`` waits for, and the grace kept to close with the
broker. Nothing above this module asks which mode it runs in.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Protocol, cast

import anyio
import anyio.lowlevel

from ._consumer import ConsumerHost, pump
from ._dead_letters import DEADLETTER_TOPIC, DeadLetter, DeadLetterQueue, DeadLetterReason
from ._dedup import DedupStore
from ._envelope import Envelope, Receipt, make_receipt, make_receipts
from ._exceptions import BusClosedError, ConfigurationError, EncodeError, PublishTimeout
from ._routing import Router, compile_pattern
from ._stage import Backpressure, DoorOutcome, Stage
from .transports._bound import BoundTransport
from .transports._codec import Codec, encode_payload
from .transports.base import DedupStoreProvider, Transport, TransportSettings

__all__ = [
    "INBOX",
    "BrokerMode",
    "LocalMode",
    "Mode",
    "ModeHost",
    "Progress",
    "choose_mode",
    "split_stage_name",
]

dead_letter_logger = logging.getLogger("asyncbus.dead_letters")

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

    def store(self, entry: DeadLetter) -> None:
        """Keep ``entry`` where other processes see it too (nothing in memory)."""

    def forget(self, ids: Sequence[str]) -> None:
        """The dead letters ``ids`` left the queue: forget their stored copies."""

    async def replay(self, entry: DeadLetter, envelope: Envelope) -> Receipt:
        """Send ``envelope`` (``entry``'s, made new) to the stage that dead-lettered it."""

    def replies_elsewhere(self, reply_to: str) -> bool:
        """Whether ``reply_to`` names a requester in another process."""

    async def reply_address(self, request_id: str, inbox: Callable[[], Awaitable[str]]) -> str:
        """Where the reply to request ``request_id`` goes (``inbox`` opens this bus's)."""

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, ``None`` in memory or without one."""

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope for settling with the broker, bounded by the close deadline."""


def choose_mode(
    transport: Transport | None,
    router: Router[Stage],
    stages: dict[str, Stage],
    host: ModeHost,
    observers: list[Callable[[Envelope], None]],
    codec: object | None,
) -> Mode:
    """The mode of a bus over ``transport``, chosen once (``codec`` is the broker's)."""
    if transport is not None and not isinstance(transport, Transport):
        raise ConfigurationError(
            f"Bus: transport must be a asyncbus.transports.Transport, got {transport!r}"
        )
    local = LocalMode(router, stages, host, observers)
    if transport is None or transport.direct:
        return local
    return BrokerMode(transport, local, codec)


class LocalMode:
    """Envelopes wait in this process's stages: the router offers them at each door."""

    system = "memory"
    admits_inline = True

    def __init__(
        self,
        router: Router[Stage],
        stages: dict[str, Stage],
        host: ModeHost,
        observers: list[Callable[[Envelope], None]],
    ) -> None:
        self.router = router
        #: The bus's stages by name (the same dict).
        self.stages = stages
        self.host = host
        #: Told of every envelope routed (the bus's list, shared).
        self.observers = observers

    async def open(self, stack: AsyncExitStack, dead_letters: DeadLetterQueue) -> None:
        """Nothing to enter in memory."""

    def close_by(self, deadline: float) -> float:
        """All of the deadline is for draining."""
        return deadline

    def lost_acks(self) -> Iterable[tuple[str, str]]:
        """No broker, no ack to lose."""
        return ()

    async def backlog(self, stages: Iterable[Stage]) -> int:
        """Nothing waits outside the stages."""
        return 0

    def start(self, stage: Stage) -> None:
        """Publishes fill the stage themselves."""

    def check_nowait(self) -> None:
        """A publish can always be tried at once in memory."""

    def observe(self, envelope: Envelope) -> None:
        """Tell the observers of ``envelope``."""
        for observe in self.observers:
            observe(envelope)

    def publish_yield(
        self, yield_now: Callable[[], Awaitable[None]]
    ) -> Callable[[], Awaitable[None]]:
        """The backend's yield: a publish yields before it admits anything."""
        return yield_now

    async def send(
        self, envelope: Envelope, timeout: float | None, progress: Progress | None = None
    ) -> Receipt:
        """Offer ``envelope`` to every stage of its topic (see :meth:`deliver`)."""
        if self.observers:
            self.observe(envelope)
        return await self.deliver(envelope, timeout, progress)

    def send_now(self, envelope: Envelope) -> Receipt:
        """Admit ``envelope`` everywhere or nowhere: a full ``BLOCK`` stage refuses it all."""
        self.observe(envelope)
        stages = self.router.route(envelope.topic)
        for stage in stages:
            if stage.backpressure is Backpressure.BLOCK and not stage.has_room():
                raise anyio.WouldBlock(f"stage {stage.name!r} is full")
        receipt, blocked = self.offer(envelope, stages)
        assert not blocked
        return receipt

    def offer(self, envelope: Envelope, stages: tuple[Stage, ...]) -> tuple[Receipt, list[Stage]]:
        """Offer ``envelope`` at each door: the receipt so far and the stages that are full."""
        if not stages:
            if envelope.topic != DEADLETTER_TOPIC:  # a dead letter never begets one
                self.host.dead_letter(envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0)
            return Receipt(envelope.id), []
        if len(stages) == 1:
            stage = stages[0]
            admission = stage.offer(envelope)
            if admission is DoorOutcome.ACCEPTED:
                return make_receipt(envelope.id, stage.names), []
            if admission is DoorOutcome.BLOCKED:
                return Receipt(envelope.id), [stage]
            if admission is DoorOutcome.REJECTED:
                return Receipt(envelope.id, rejected=(stage.name,)), []
            return Receipt(envelope.id, dropped=(stage.name,)), []
        accepted: list[str] = []
        rejected: list[str] = []
        dropped: list[str] = []
        blocked: list[Stage] = []
        for stage in stages:
            admission = stage.offer(envelope)
            if admission is DoorOutcome.ACCEPTED:
                accepted.append(stage.name)
            elif admission is DoorOutcome.BLOCKED:
                blocked.append(stage)
            elif admission is DoorOutcome.REJECTED:
                rejected.append(stage.name)
            else:
                dropped.append(stage.name)
        return Receipt(envelope.id, tuple(accepted), tuple(rejected), tuple(dropped)), blocked

    async def deliver(
        self, envelope: Envelope, timeout: float | None, progress: Progress | None = None
    ) -> Receipt:
        """Offer ``envelope`` to every stage of its topic, waiting (up to ``timeout``)
        where a ``BLOCK`` stage is full.

        :param progress: kept up to date with what is admitted so far, for a caller
            that may be cancelled while this waits (its receipt is then still known).
        """
        receipt, blocked = self.offer(envelope, self.router.route(envelope.topic))
        if not blocked:
            return receipt
        return await self.wait_for_room(envelope, receipt, blocked, timeout, progress)

    async def wait_for_room(
        self,
        envelope: Envelope,
        receipt: Receipt,
        blocked: list[Stage],
        timeout: float | None,
        progress: Progress | None = None,
        *,
        named: str | None = None,
    ) -> Receipt:
        """Admit ``envelope`` into the full ``BLOCK`` stages ``blocked`` as room appears
        (up to ``timeout``); ``receipt`` is what the other stages did at the door.

        :param named: the timeout the caller was given, as its error tells it (when
            ``timeout`` is what is left of it).
        """
        accepted = list(receipt.accepted)
        if progress is not None:
            progress.receipt = receipt
        waiting_on = blocked[0]
        with anyio.move_on_after(timeout) as scope:
            for waiting_on in blocked:
                try:
                    await waiting_on.put(envelope)
                except BusClosedError as error:
                    # The stage stopped before it had room: nothing was admitted there.
                    raise BusClosedError(
                        str(error),
                        receipt=Receipt(
                            envelope.id, tuple(accepted), receipt.rejected, receipt.dropped
                        ),
                    ) from None
                accepted.append(waiting_on.name)
                if progress is not None:
                    progress.receipt = Receipt(
                        envelope.id, tuple(accepted), receipt.rejected, receipt.dropped
                    )
        receipt = Receipt(envelope.id, tuple(accepted), receipt.rejected, receipt.dropped)
        if scope.cancelled_caught:
            raise PublishTimeout(
                f"stage {waiting_on.name!r} stayed full for {timeout}s"
                if named is None
                else f"stage {waiting_on.name!r} stayed full past the timeout of {named}",
                receipt=receipt,
            )
        return receipt

    async def send_many(
        self, envelopes: Sequence[Envelope], timeout: float | None
    ) -> list[Receipt]:
        """Offer each envelope (in order) to every stage of the topic.

        When every stage has room for all of them and nobody waits for room, all are
        admitted at once; otherwise each is offered at each door with the stage's
        policy, a full ``BLOCK`` stage holding the rest back until it has room.
        """
        topic = envelopes[0].topic
        stages = self.router.route(topic)
        count = len(envelopes)
        if stages and all(
            stage.capacity - stage.queued >= count and not stage.room_waiters for stage in stages
        ):
            if self.observers:
                for envelope in envelopes:
                    self.observe(envelope)
            listed = list(envelopes)
            for stage in stages:
                stage.admit_many(listed)
            return make_receipts(envelopes, self.router.names(topic))
        receipts: list[Receipt] = []
        deadline = None if timeout is None else anyio.current_time() + timeout
        index = 0
        try:
            while index < count:
                stages = self.router.route(topic)
                # As many of the rest as every stage has room for (nobody waiting): at once.
                room = min(
                    (
                        0 if stage.room_waiters else stage.capacity - stage.queued
                        for stage in stages
                    ),
                    default=0,
                )
                full = [
                    stage
                    for stage in stages
                    if stage.backpressure is Backpressure.BLOCK and not stage.has_room()
                ]
                left = None if deadline is None else max(0.0, deadline - anyio.current_time())
                # A full BLOCK stage: wait for room for a run of the rest, before this
                # envelope is offered anywhere (once per run, not once per envelope).
                if (
                    room <= 0
                    and full
                    and left != 0.0
                    and await self.wait_for_batch_room(envelopes[index], full, count - index, left)
                ):
                    # First in line at the stages waited for: their room is ours.
                    room = min(
                        stage.capacity - stage.queued
                        if stage in full or not stage.room_waiters
                        else 0
                        for stage in stages
                    )
                if room > 0:
                    run = list(envelopes[index : index + room])
                    if self.observers:
                        for envelope in run:
                            self.observe(envelope)
                    for stage in stages:
                        stage.admit_many(run)
                        if stage.room_waiters and stage.queued < stage.capacity:
                            stage.wake_one()  # room beyond ours: keep the line moving
                    receipts += make_receipts(run, self.router.names(topic))
                    index += len(run)
                    continue
                # One envelope at each door with the stage's policy (out of time, or a
                # stage that rejects or drops).
                envelope = envelopes[index]
                if self.observers:
                    self.observe(envelope)
                receipt, blocked = self.offer(envelope, stages)
                if blocked:
                    receipt = await self.wait_for_room(
                        envelope, receipt, blocked, left, named=f"{timeout}s for the batch"
                    )
                receipts.append(receipt)
                index += 1
        except (PublishTimeout, BusClosedError) as error:
            error.receipts = receipts  # those sent before the one cut off
            raise
        return receipts

    @staticmethod
    async def wait_for_batch_room(
        envelope: Envelope, full: list[Stage], rest: int, timeout: float | None
    ) -> bool:
        """Wait (at most ``timeout``) until the full ``BLOCK`` stages have room for a run
        of the ``rest`` of a batch (up to half a stage's capacity), ``envelope`` first.

        :returns: whether they have; ``False`` when time ran out (whatever room there is
            then is taken one envelope at a time, until one must wait).
        :raises BusClosedError: when a stage stops first (nothing of ``envelope`` was
            admitted anywhere).
        """
        try:
            if timeout is None:
                for stage in full:
                    await stage.wait_for_room_for(min(rest, max(1, stage.capacity // 2)))
                return True
            with anyio.move_on_after(timeout) as scope:
                for stage in full:
                    await stage.wait_for_room_for(min(rest, max(1, stage.capacity // 2)))
        except BusClosedError as error:
            raise BusClosedError(str(error), receipt=Receipt(envelope.id)) from None
        return not scope.cancelled_caught

    def store(self, entry: DeadLetter) -> None:
        """The bus's dead-letter queue is the only one."""

    def forget(self, ids: Sequence[str]) -> None:
        """Nothing stored elsewhere."""

    async def replay(self, entry: DeadLetter, envelope: Envelope) -> Receipt:
        """Into the stage that dead-lettered it (waiting for room), else to the topic."""
        stage = self.stages.get(entry.stage) if entry.stage else None
        if stage is None:
            return await self.send(envelope, None)
        self.observe(envelope)
        await stage.put(envelope)
        return Receipt(envelope.id, (stage.name,))

    def replies_elsewhere(self, reply_to: str) -> bool:
        """Every requester is in this process."""
        return False

    async def reply_address(self, request_id: str, inbox: Callable[[], Awaitable[str]]) -> str:
        """The request's own id: the reply never leaves the process."""
        return request_id

    def dedup_store(self, window: float) -> DedupStore | None:
        """No broker: each ``deduplicate()`` keeps its own memory."""
        return None

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope (nothing is settled with a broker in memory)."""
        return anyio.CancelScope(shield=True)


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

    def __init__(self, transport: Transport, local: LocalMode, codec: object | None) -> None:
        self.transport = transport
        #: The transport and the optional protocols it implements, looked up once.
        self.port = BoundTransport.of(transport)
        self.codec = cast("Codec | None", codec)
        self.local = local
        self.host = local.host
        self.system = transport.name

    async def open(self, stack: AsyncExitStack, dead_letters: DeadLetterQueue) -> None:
        """Enter the transport for this life of the bus and restore its dead letters."""
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
        for entry in await self.port.dead_letters():
            dead_letters.restore(entry)

    def close_by(self, deadline: float) -> float:
        """Keep the end of the deadline for closing with the broker.

        Settling, releasing deliveries and closing connections get it however silent
        the broker is: what it could not settle it delivers again later. (``close_by``
        only ever brings the transport's deadline forward.)
        """
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
        """A cancellation check only when the transport's publish always waits for the
        broker (``publish_waits``): that wait is the publish's one yield (a second pass
        of the event loop per publish cost a RabbitMQ publisher about a fifth of its CPU
        per message). Otherwise the backend's yield, first, as in memory."""
        if self.transport.publish_waits:
            return anyio.lowlevel.checkpoint_if_cancelled
        return yield_now

    def lost_acks(self) -> Iterable[tuple[str, str]]:
        """Acks written behind that the broker never got."""
        return self.port.unsettled_acks()

    async def backlog(self, stages: Iterable[Stage]) -> int:
        """What the broker still holds for the stages it feeds."""
        total = 0
        for stage in list(stages):
            if over_broker(stage):
                total += await self.port.backlog(stage.pattern, stage.group)
        return total

    def start(self, stage: Stage) -> None:
        """Start the stage's pump (once), unless it is a ``$deadletter`` stage."""
        if over_broker(stage) and not stage.pumping:
            stage.pumping = True
            stage.subscribed = anyio.Event()
            self.host.start_soon(
                pump, stage, self.transport, self.host, name=f"asyncbus pump {stage.name}"
            )

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
        if local.observers:
            local.observe(envelope)
        if envelope.topic == DEADLETTER_TOPIC:
            # No broker round trip to be the publish's one yield (see ``publish_yield``).
            await self.host.yield_now()
            return await local.deliver(envelope, timeout, progress)
        broker = self.transport
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
        return make_receipt(envelope.id, reached)

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
        return make_receipts(listed, reached)

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

    def forget(self, ids: Sequence[str]) -> None:
        """Remove the stored copies of ``ids``, in the background."""
        if ids:
            self.host.start_background(self._forget, list(ids))

    async def _forget(self, ids: list[str]) -> None:
        try:
            with self.transport.cleanup_scope():
                await self.port.remove_dead_letters(ids)
        except Exception:
            dead_letter_logger.warning("could not remove dead letters %s", ids, exc_info=True)

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
        with anyio.CancelScope(shield=True):
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

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """The transport's shielded scope, bounded by its close deadline."""
        return self.transport.cleanup_scope()


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
