"""The mode of a bus whose envelopes wait in this process's stages."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from functools import partial

import anyio
import anyio.lowlevel

from .._cluster import Heartbeats
from .._dead_letters import DEADLETTER_TOPIC, DeadLetter, DeadLetterQueue, DeadLetterReason
from .._dedup import DedupStore, MemoryDedupStore
from .._door import DoorOutcome, RoomWaiter
from .._envelope import Envelope, Receipt, make_receipt, make_receipts
from .._exceptions import BusClosedError, PublishTimeout
from .._groups import GroupInfo, local_groups, subscribed_here
from .._leases import LeaseStore
from .._partitions import Partitions
from .._rates import RateStore
from .._routing import Router
from .._stage import Backpressure, Stage
from .._time.due import BusTime
from .._time.held import Fire, Keeper, LocalKeeper
from .mode import ModeHost, Progress

__all__ = ["LocalMode"]


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

    def check_pattern(self, pattern: str) -> None:
        """Any pattern the bus's syntax allows works in memory."""

    def check_partitions(self, pattern: str, partitions: int | None) -> None:
        """One process serves every partition: the order per key holds whatever their
        number."""

    def partitions(self, stage: Stage, count: int | None) -> Partitions | None:
        """One process: an ordered group is never split."""
        return None

    def check_topic(self, topic: str) -> None:
        """Any topic the bus's syntax allows works in memory."""

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

        It takes its place in the line of every one of them at once, so a publish made
        after it (from the same thread or task) gets in after it everywhere; each stage
        admits it when its turn comes, whether or not its task runs then.

        :param named: the timeout the caller was given, as its error tells it (when
            ``timeout`` is what is left of it).
        """
        if progress is not None:
            progress.receipt = receipt
        lines = [(stage, stage.line_up(enter=partial(stage.admit, envelope))) for stage in blocked]
        for stage in blocked:
            stage.entering += 1  # drain() does not call the stage idle meanwhile
        closed: BusClosedError | None = None
        try:
            with anyio.move_on_after(timeout):
                for stage, waiter in lines:
                    try:
                        await stage.wait_in_line(waiter)
                    except BusClosedError as error:
                        closed = error  # the stage stopped first: nothing admitted there
                        break
                    if progress is not None:
                        progress.receipt = _admitted(envelope, receipt, lines)
        finally:
            for stage, waiter in lines:
                stage.leave(waiter)  # (nothing when it was admitted)
                stage.entering -= 1
                stage.host.settled(stage)
            if progress is not None:  # (cancelled: what was admitted, whatever the task saw)
                progress.receipt = _admitted(envelope, receipt, lines)
        admitted = _admitted(envelope, receipt, lines)
        if closed is not None:
            raise BusClosedError(str(closed), receipt=admitted)
        waiting_on = next((stage for stage, waiter in lines if not waiter.handed), None)
        if waiting_on is not None:
            raise PublishTimeout(
                f"stage {waiting_on.name!r} stayed full for {timeout}s"
                if named is None
                else f"stage {waiting_on.name!r} stayed full past the timeout of {named}",
                receipt=admitted,
            )
        return admitted

    async def send_many(
        self, envelopes: Sequence[Envelope], timeout: float | None
    ) -> list[Receipt]:
        """Offer each envelope (in order) to every stage of the topic.

        When every stage has room for all of them and nobody waits for room, all are
        admitted at once; otherwise each is offered at each door with the stage's
        policy, a full ``BLOCK`` stage holding the rest back until it has room.
        ``timeout`` is one deadline for the whole call.
        """
        topic = envelopes[0].topic
        stages = self.router.route(topic)
        count = len(envelopes)
        if stages and all(stage.has_room(count) for stage in stages):
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
                room = min((stage.free_room() for stage in stages), default=0)
                full = [
                    stage
                    for stage in stages
                    if stage.backpressure is Backpressure.BLOCK and not stage.has_room()
                ]
                # A full BLOCK stage: wait for room for a run of the rest, before this
                # envelope is offered anywhere (once per run, not once per envelope).
                if (
                    room <= 0
                    and full
                    and _left(deadline) != 0.0
                    and await self.wait_for_batch_room(
                        envelopes[index], full, count - index, _left(deadline)
                    )
                ):
                    # Our room at the stages waited for (taken just now); elsewhere, room
                    # nobody waits for.
                    room = min(
                        stage.capacity - stage.queued - stage.reserved
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
                        if stage.room_waiters:
                            stage.hand_room()  # room beyond ours: keep the line moving
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
                        envelope,
                        receipt,
                        blocked,
                        _left(deadline),
                        named=f"{timeout}s for the batch",
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

        It waits in the line of every one at once, holding the room each hands it
        until all have; then it takes that room (the caller admits the run at once).

        :returns: whether they have; ``False`` when time ran out (whatever room there is
            then is taken one envelope at a time, until one must wait).
        :raises BusClosedError: when a stage stops first (nothing of ``envelope`` was
            admitted anywhere).
        """
        lines = [(stage, stage.line_up(min(rest, max(1, stage.capacity // 2)))) for stage in full]
        for stage in full:
            stage.entering += 1  # as in put(): drain() must not call the stage idle meanwhile
        taken = False
        try:
            if timeout is None:  # (no cancel scope to make: the common case)
                await _take_room_in_every_line(lines)
                taken = True
            else:
                with anyio.move_on_after(timeout):
                    await _take_room_in_every_line(lines)
                    taken = True
        except BusClosedError as error:
            raise BusClosedError(str(error), receipt=Receipt(envelope.id)) from None
        finally:
            for stage, waiter in lines:
                if not taken:
                    stage.leave(waiter)  # the room it held goes to the next in line
                stage.entering -= 1
                stage.host.settled(stage)
        return taken

    async def send_none(self) -> list[Receipt]:
        """A ``publish_many`` of nothing (it yielded already)."""
        return []

    def store(self, entry: DeadLetter) -> None:
        """The bus's dead-letter queue is the only one."""

    def forget(self, ids: Sequence[str], everything: bool = False) -> None:
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

    def rate_store(self) -> RateStore | None:
        """No broker: each ``RateLimit`` keeps its own turns."""
        return None

    def lease_store(self) -> LeaseStore | None:
        """No broker: ``max_in_flight`` counts this process's handlers."""
        return None

    def time_keeper(self, clock: BusTime, fire: Fire) -> Keeper:
        """This process holds scheduled envelopes (abandoned at the close)."""
        return LocalKeeper(clock, fire)

    def claim_store(self) -> tuple[DedupStore, bool]:
        """This process's own claims: it is the only replica there is."""
        return MemoryDedupStore(), False

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope (nothing is settled with a broker in memory)."""
        return anyio.CancelScope(shield=True)

    def heartbeats(self) -> Heartbeats | None:
        """None: in memory the deployment is this process."""
        return None

    def groups_now(self, running: bool) -> list[GroupInfo]:
        """The bus's stages, with their figures (at any time: nothing to reach)."""
        return local_groups(stage.statistics() for stage in list(self.stages.values()))

    async def groups(self, running: bool) -> list[GroupInfo]:
        """The bus's stages, with their figures (at any time: nothing to reach)."""
        await anyio.lowlevel.checkpoint()
        return self.groups_now(running)

    async def delete_group(self, pattern: str, group: str, force: bool, running: bool) -> bool:
        """In memory a group is a stage of this bus: refused if it is one, else ``False``."""
        await anyio.lowlevel.checkpoint()
        if f"{pattern}@{group}" in self.stages:
            raise subscribed_here(pattern, group)
        return False


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (``None``: no deadline), never below 0."""
    return None if deadline is None else max(0.0, deadline - anyio.current_time())


async def _take_room_in_every_line(lines: list[tuple[Stage, RoomWaiter]]) -> None:
    """Wait until every line handed its waiter room, then take it all at once.

    :raises BusClosedError: when a stage stops first.
    """
    for stage, waiter in lines:
        await stage.wait_in_line(waiter)
    for stage, _ in lines:
        if stage.closed:  # (stopped after it handed us room: take none of it)
            raise BusClosedError(f"stage {stage.name!r} stopped before it had room")
    for stage, waiter in lines:
        stage.take_room(waiter)


def _admitted(
    envelope: Envelope, receipt: Receipt, lines: list[tuple[Stage, RoomWaiter]]
) -> Receipt:
    """``receipt`` with the waiting stages that admitted ``envelope`` added."""
    accepted = receipt.accepted + tuple(stage.name for stage, waiter in lines if waiter.handed)
    return Receipt(envelope.id, accepted, receipt.rejected, receipt.dropped)
