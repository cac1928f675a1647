"""An ordered group split into partitions, each served by one replica at a time.

``subscribe(..., ordering="key", partitions=N)`` over a broker that keeps leases
(Redis, NATS, PostgreSQL). Each envelope belongs to one partition, by a stable hash of
its publish key (:func:`partition_of`: CRC-32, the same in every process and language;
an envelope without a key by its id). Each partition is a group of its own in the
broker, named ``"{group}#{index}/{N}"``: the broker keeps the count in the names, and a
replica subscribing with another count is refused (:class:`ConfigurationError`).
Every partition's group receives every envelope of the pattern; its consumer takes in
the envelopes of its partition and acks the others at once, uncounted. So a key's
envelopes reach one replica, in publish order, and that replica's key gate (see
:mod:`asyncbus._ordering`) hands them out one at a time.

Who serves a partition is a lease in the broker (one slot named after it), renewed
every :data:`RENEW_EVERY` seconds. The replicas count one another (a lease each,
:class:`~asyncbus._leases.LeaseCounter`) and each aims at its share of the partitions,
``N // replicas`` or one more: a replica short of the smaller share says so (a
*hungry* lease) and the others give one partition each back until it has it.

Giving a partition back is a hand-over: its consumer stops taking envelopes in, the
ones taken in are settled (at most :data:`HAND_OVER` seconds), its subscription ends,
and only then is its lease released; the next owner starts where it stopped. A
replica that could not renew for :data:`STOP_AFTER` seconds (before the lease runs out
at :data:`LEASE`) stops the partition at once: what it took in and has not started is
given back to the broker unhandled (counted ``abandoned`` here), so no other replica
handles a key while it does. A partition whose server died, or stopped that way, is
*marked* in the broker; its next owner reads it only after the transport's
``ack_timeout``, once the broker has made the dead server's unsettled envelopes
available again, so they come before their keys' later ones.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import uuid
import zlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import anyio
import anyio.abc

from ._envelope import HEADER_KEY, Envelope
from ._exceptions import ConfigurationError, TransportError
from ._failures import describe_error
from ._leases import LeaseCounter, LeaseStore, PartitionLeases
from ._types import Handler
from ._verdicts import GiveBack

__all__ = [
    "HAND_OVER",
    "LEASE",
    "RENEW_EVERY",
    "STOP_AFTER",
    "LeasedPartitions",
    "Partitions",
    "fold_partitions",
    "partition_group",
    "partition_of",
    "split_partition_group",
]

logger = logging.getLogger("asyncbus.partitions")

#: Seconds a partition's lease lasts unless renewed: how long a dead replica's
#: partitions wait before another replica takes them.
LEASE = 10.0
#: Seconds between two rounds of renewing and balancing.
RENEW_EVERY = LEASE / 4
#: Seconds without a renewal after which a replica stops serving its partitions (before
#: their leases run out, so that no other replica can take one while it still serves).
STOP_AFTER = LEASE * 0.6
#: Most seconds a partition given back waits for what it took in to be settled.
HAND_OVER = 30.0
#: Seconds the mark of a partition being served lasts (renewed with its lease).
_MARK = 7 * 86_400.0
#: The most replicas counted (a bound for the members' lease).
_MEMBERS = 1 << 20

_GROUP = re.compile(r"^(?P<group>.+)#(?P<index>\d+)/(?P<count>\d+)$", re.DOTALL)
_NAME = re.compile(r"#\d+/\d+$")

GIVE_BACK = GiveBack()


def partition_of(envelope: Envelope, count: int) -> int:
    """The partition of ``envelope`` among ``count``: CRC-32 of its publish key (of its
    id when it has none), UTF-8, modulo ``count``."""
    key = envelope.headers.get(HEADER_KEY)
    text = key if isinstance(key, str) else envelope.id
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % count


def partition_group(group: str, index: int, count: int) -> str:
    """The broker's group of partition ``index`` of ``count`` of ``group``."""
    return f"{group}#{index}/{count}"


def split_partition_group(group: str) -> tuple[str, int, int] | None:
    """``(group, index, count)`` of a partition's group name, ``None`` for another name."""
    found = _GROUP.match(group)
    if found is None:
        return None
    index, count = int(found["index"]), int(found["count"])
    if not 0 <= index < count:
        return None
    return found["group"], index, count


def _shielded(seconds: float) -> anyio.CancelScope:
    """A scope shielded from cancellation that ends after ``seconds``."""
    return anyio.CancelScope(shield=True, deadline=anyio.current_time() + seconds)


def fold_partitions(reached: tuple[str, ...]) -> tuple[str, ...]:
    """Stage names a publish reached, each partition's named as its group's stage."""
    if not any("#" in name for name in reached):
        return reached
    return tuple(sorted({_NAME.sub("", name) for name in reached}))


class LeasedPartitions:
    """:class:`~asyncbus._leases.PartitionLeases` made of a broker's leases (a
    :class:`~asyncbus._leases.LeaseStore` that is a :class:`~asyncbus._leases.LeaseCounter`
    too: Redis, NATS, PostgreSQL): a lease of one slot per partition, renewed every
    round; the replicas counted by a lease each; a mark, a long lease of its own."""

    def __init__(self, store: LeaseStore) -> None:
        assert isinstance(store, LeaseCounter)
        self._store: Any = store

    async def count_in(self, name: str, member: str) -> int:
        """Count ``member`` in (renewed by calling again): how many are counted now."""
        await self._store.acquire(name, _MEMBERS, member, LEASE)
        return int(await self._store.count(name))

    async def count_out(self, name: str, member: str) -> None:
        """Count ``member`` out."""
        await self._store.release(name, member)

    async def count(self, name: str) -> int:
        """How many are counted in."""
        return int(await self._store.count(name))

    async def take(self, name: str, member: str) -> bool:
        """Take the lease ``name`` for ``member``: whether it was free (or its already)."""
        return bool(await self._store.acquire(name, 1, member, LEASE))

    async def keep(self, name: str, member: str) -> bool:
        """Renew ``member``'s lease ``name``: whether it still held it."""
        return bool(await self._store.renew(name, [member], LEASE))

    async def give(self, name: str, member: str) -> None:
        """Give ``member``'s lease ``name`` back."""
        await self._store.release(name, member)

    async def mark(self, name: str) -> None:
        """Set the mark ``name`` (kept until unmarked, or for a week)."""
        await self._store.acquire(name, 1, "served", _MARK)

    async def unmark(self, name: str) -> None:
        """Clear the mark ``name``."""
        await self._store.release(name, "served")

    async def marked(self, name: str) -> bool:
        """Whether the mark ``name`` is set."""
        return bool(await self._store.count(name))


class _Served:
    """One partition this replica holds: its pump task and how it ends."""

    __slots__ = ("index", "leaving", "reading", "scope", "stopped", "subscribed")

    def __init__(self, index: int) -> None:
        self.index = index
        #: Being handed over (no longer counted in this replica's share).
        self.leaving = False
        #: The pump's reading now, cancelled to stop taking envelopes in (a hand-over;
        #: a pump that finds ``leaving`` set does not read).
        self.reading: anyio.CancelScope | None = None
        #: The pump's whole task (its subscription), cancelled to stop at once.
        self.scope = anyio.CancelScope()
        self.stopped = anyio.Event()
        #: Set by the pump once the partition's subscription exists.
        self.subscribed = anyio.Event()


class Partitions:
    """The partitions of one ordered stage over a broker, and which this replica serves.

    :param stage: the stage (its ``pattern``, ``group`` and ``name``).
    :param count: the stage's ``partitions``.
    """

    def __init__(self, stage: Any, count: int) -> None:
        self.stage = stage
        self.count = count
        self.instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        #: Partitions this replica holds (serving, or handing over).
        self.served: dict[int, _Served] = {}
        #: Ids of envelopes taken in from a partition this replica stopped at once,
        #: given back unhandled when a consumer reaches them.
        self.given_back: set[str] = set()
        #: Replicas of the group, as last counted.
        self.members = 1
        self._renewed = -math.inf
        self._hungry = False
        self._unreachable = False
        self._linger = 0.0
        self._serve: Callable[[int, str, _Served], Any] | None = None
        self._settle_wait = 0.0

    # -- names in the lease store ------------------------------------------------

    def _lease(self, index: int) -> str:
        return f"{self.stage.name}#partition-{index}/{self.count}"

    def _mark(self, index: int) -> str:
        return f"{self.stage.name}#served-{index}/{self.count}"

    @property
    def _members(self) -> str:
        return f"{self.stage.name}#replicas/{self.count}"

    @property
    def _hungry_name(self) -> str:
        return f"{self.stage.name}#hungry/{self.count}"

    # -- what the stage asks -------------------------------------------------------

    @property
    def owned(self) -> list[int]:
        """The partitions this replica serves now (hand-overs included), in order."""
        return sorted(self.served)

    def groups(self) -> list[str]:
        """The broker groups of the partitions this replica serves."""
        return [partition_group(self.stage.group, index, self.count) for index in self.owned]

    def accepts(self, index: int) -> Callable[[Any], bool]:
        """Whether a delivery of partition ``index``'s group is its partition's (one
        that could not be decoded is partition 0's, which dead-letters it)."""
        count = self.count

        def accept(delivery: Any) -> bool:
            envelope = getattr(delivery, "envelope", None)
            if getattr(delivery, "error", None) is not None or not isinstance(envelope, Envelope):
                return index == 0
            return partition_of(envelope, count) == index

        return accept

    def guard(self, chain: Handler) -> Handler:
        """``chain``, except for an envelope of a partition stopped at once: given back."""
        given_back = self.given_back

        async def handle(envelope: Any) -> Any:
            if given_back and envelope.id in given_back:
                given_back.discard(envelope.id)
                return GIVE_BACK
            return await chain(envelope)

        return handle

    # -- serving -----------------------------------------------------------------

    async def run(
        self,
        store: PartitionLeases,
        serve: Callable[[int, str, _Served], Any],
        settle_wait: float,
        recorded: Iterable[tuple[str, str]] | None,
        ready: anyio.Event | None,
        linger: float = 0.0,
        cleanup: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """Hold this replica's share of the partitions until cancelled (the bus stops),
        then give them back.

        :param store: where the broker keeps the partitions' leases.
        :param serve: ``serve(index, group, served)`` pumps a partition's group until
            cancelled, reading only within ``served.reading``.
        :param settle_wait: the transport's ``ack_timeout``: how long a partition whose
            server died waits before it is read.
        :param recorded: the broker's (pattern, group) pairs, to refuse another count.
        :param ready: set after the first round (the stage's subscription exists).
        :param linger: seconds a subscription that ended may still be sent envelopes,
            which it gives back (NATS: an open pull request lives that long); a
            hand-over waits as long before the next owner may read.
        :param cleanup: the shielded scope, bounded by the bus's close deadline, in which
            the partitions are given back when the bus stops (the transport's
            ``cleanup_scope``); by default shielded for a third of :data:`LEASE`.
        """
        self._linger = linger
        self._serve, self._settle_wait = serve, settle_wait
        self._check_recorded(recorded)
        try:
            async with anyio.create_task_group() as serving:
                while True:
                    started = await self._round(store, serving)
                    if ready is not None and not ready.is_set():
                        for served in started:  # the groups exist before a start ends
                            with anyio.move_on_after(LEASE):
                                await served.subscribed.wait()
                        ready.set()
                    await anyio.sleep(RENEW_EVERY * random.uniform(0.8, 1.0))
        finally:
            # The pumps have ended (their subscriptions gave back what they held).
            scope = cleanup() if cleanup is not None else _shielded(LEASE / 3 + linger)
            with scope:
                await self._leave(store)

    def _check_recorded(self, recorded: Iterable[tuple[str, str]] | None) -> None:
        stage = self.stage
        for pattern, group in recorded or ():
            split = split_partition_group(group)
            if pattern != stage.pattern or split is None or split[0] != stage.group:
                continue
            if split[2] != self.count:
                raise ConfigurationError(
                    f"subscribe({stage.pattern!r}, group={stage.group!r}): partitions="
                    f"{self.count}, but the broker holds this group split into {split[2]} "
                    "partitions, chosen when it was created; subscribe with "
                    f"partitions={split[2]}, or delete the group's partitions (python -m "
                    "asyncbus groups) to choose again"
                )

    async def _round(self, store: PartitionLeases, serving: anyio.abc.TaskGroup) -> list[_Served]:
        """Renew what this replica holds, then take or give back toward its share: the
        partitions taken that are read at once."""
        now = anyio.current_time()
        try:
            self.members = max(1, await store.count_in(self._members, self.instance))
            for served in list(self.served.values()):
                if not await store.keep(self._lease(served.index), self.instance):
                    logger.warning(
                        "stage %s: the lease of partition %d ran out before it was renewed: "
                        "it stops here at once",
                        self.stage.name,
                        served.index,
                    )
                    self._stop_at_once(served)
            self._renewed = now
            if self._unreachable:
                self._unreachable = False
                logger.warning(
                    "stage %s: the partitions' leases are renewed again", self.stage.name
                )
            return await self._balance(store, serving)
        except TransportError as error:
            if not self._unreachable:
                self._unreachable = True
                logger.warning(
                    "stage %s: the partitions' leases could not be renewed: %s",
                    self.stage.name,
                    describe_error(error),
                )
            if anyio.current_time() - self._renewed >= STOP_AFTER:
                for served in list(self.served.values()):
                    self._stop_at_once(served)
            return []

    async def _balance(self, store: PartitionLeases, serving: anyio.abc.TaskGroup) -> list[_Served]:
        low, high = self.count // self.members, -(-self.count // self.members)
        staying = [served for served in self.served.values() if not served.leaving]
        hungry = len(staying) < low
        if hungry:
            self._hungry = True
            await store.count_in(self._hungry_name, self.instance)
        elif self._hungry:
            self._hungry = False
            await store.count_out(self._hungry_name, self.instance)
        others_hungry = 0 if hungry else await store.count(self._hungry_name)
        extra = len(staying) - high
        if extra <= 0 and others_hungry and len(staying) > low:
            extra = 1
        for served in sorted(staying, key=lambda served: -served.index)[: max(extra, 0)]:
            served.leaving = True
            serving.start_soon(self._hand_over, store, served)
        want = (low if others_hungry else high) - len(staying)
        started: list[_Served] = []
        if want <= 0:
            return started
        start = zlib.crc32(self.instance.encode()) % self.count
        for step in range(self.count):
            index = (start + step) % self.count
            if index in self.served:
                continue
            if not await store.take(self._lease(index), self.instance):
                continue
            marked = await store.marked(self._mark(index))
            await store.mark(self._mark(index))
            served = _Served(index)
            self.served[index] = served
            serving.start_soon(self._read, served, self._settle_wait if marked else 0.0)
            if not marked:
                started.append(served)
            want -= 1
            if not want:
                break
        return started

    async def _read(self, served: _Served, wait: float) -> None:
        group = partition_group(self.stage.group, served.index, self.count)
        try:
            with served.scope:
                if wait:
                    logger.info(
                        "stage %s: partition %d was left without a hand-over: read in %g s, "
                        "once the broker gives its unsettled envelopes out again",
                        self.stage.name,
                        served.index,
                        wait,
                    )
                    await anyio.sleep(wait)
                logger.info(
                    "stage %s: this replica serves partition %d", self.stage.name, served.index
                )
                assert self._serve is not None  # (set by run)
                await self._serve(served.index, group, served)
        finally:
            served.stopped.set()

    async def _hand_over(self, store: PartitionLeases, served: _Served) -> None:
        """Stop taking partition ``served`` in, let what it took in settle, end its
        subscription, then release it (its mark too: the next owner reads at once)."""
        if served.reading is not None:
            served.reading.cancel()
        with anyio.move_on_after(HAND_OVER):
            await self._settled(served.index)
        left = self._held(served.index)
        self._give_back(left)  # not settled in time: given back when reached
        served.scope.cancel()
        await served.stopped.wait()
        await anyio.sleep(self._linger)  # what still reached it is given back first
        clean = not left
        try:
            if clean:
                await store.unmark(self._mark(served.index))
            await store.give(self._lease(served.index), self.instance)
        except TransportError as error:
            logger.warning(
                "stage %s: partition %d was not released (it runs out in %g s): %s",
                self.stage.name,
                served.index,
                LEASE,
                describe_error(error),
            )
        finally:
            if self.served.get(served.index) is served:
                del self.served[served.index]
        logger.info("stage %s: partition %d handed over", self.stage.name, served.index)

    def _held(self, index: int) -> list[str]:
        """Ids of the envelopes of partition ``index`` the stage holds unsettled."""
        count = self.count
        return [
            delivery.envelope.id
            for delivery in list(self.stage.deliveries.values())
            if partition_of(delivery.envelope, count) == index
        ]

    def _give_back(self, ids: list[str]) -> None:
        """Have the guard give back these envelopes when a consumer reaches them (those
        being handled now are not reached again, unless a retry brings them back)."""
        handled = {h.envelope.id for h in self.stage.handlings if h.envelope is not None}
        retrying = {envelope.id for envelope in self.stage.retrying.values()}
        self.given_back.update(i for i in ids if i not in handled or i in retrying)

    async def _settled(self, index: int) -> None:
        """Wait until the stage holds no delivery of partition ``index`` (a hand-over is
        rare: polled)."""
        while self._held(index):
            await anyio.sleep(0.02)

    def _stop_at_once(self, served: _Served) -> None:
        """Stop ``served`` now: what it took in and has not started is given back."""
        self._give_back(self._held(served.index))
        served.scope.cancel()
        if self.served.get(served.index) is served:
            del self.served[served.index]

    async def _leave(self, store: PartitionLeases) -> None:
        """The bus stops: give every partition held back (what was taken in has been
        settled or released by then, and what a subscription's last request brought is
        given back after :attr:`_linger`), and leave the group's count."""
        try:
            if self.served and self._linger:
                await anyio.sleep(self._linger)
            for index in list(self.served):
                await store.unmark(self._mark(index))
                await store.give(self._lease(index), self.instance)
            if self._hungry:
                await store.count_out(self._hungry_name, self.instance)
            await store.count_out(self._members, self.instance)
        except TransportError as error:
            logger.warning(
                "stage %s: partitions not released (they run out in %g s): %s",
                self.stage.name,
                LEASE,
                describe_error(error),
            )
        self.served.clear()
        self._hungry = False
