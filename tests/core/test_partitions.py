"""The partitions of an ordered group, as the replicas share them (``_partitions.py``):
balanced among the replicas that are counted in, handed over when one joins or leaves,
stopped at once when a lease is lost or cannot be renewed; with an in-memory lease store
that behaves as the brokers' do (leases exclusive, counts per name), and short leases."""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from asyncbus import HEADER_KEY, ConfigurationError, Envelope, TransportError
from asyncbus import _partitions as partitions_module
from asyncbus._leases import PartitionLeases
from asyncbus._partitions import (
    Partitions,
    fold_partitions,
    partition_group,
    partition_of,
    split_partition_group,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

COUNT = 4


@pytest.fixture(autouse=True)
def short_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(partitions_module, "LEASE", 0.4)
    monkeypatch.setattr(partitions_module, "RENEW_EVERY", 0.02)
    monkeypatch.setattr(partitions_module, "STOP_AFTER", 0.2)


class Leases:
    """A :class:`PartitionLeases` in memory, shared by the replicas of a test."""

    def __init__(self) -> None:
        self.counted: dict[str, set[str]] = defaultdict(set)
        self.held: dict[str, str] = {}
        self.marks: set[str] = set()
        self.down = False

    def _answer(self) -> None:
        if self.down:
            raise TransportError("the broker does not answer")

    async def count_in(self, name: str, member: str) -> int:
        self._answer()
        self.counted[name].add(member)
        return len(self.counted[name])

    async def count_out(self, name: str, member: str) -> None:
        self._answer()
        self.counted[name].discard(member)

    async def count(self, name: str) -> int:
        self._answer()
        return len(self.counted[name])

    async def take(self, name: str, member: str) -> bool:
        self._answer()
        return self.held.setdefault(name, member) == member

    async def keep(self, name: str, member: str) -> bool:
        self._answer()
        return self.held.get(name) == member

    async def give(self, name: str, member: str) -> None:
        self._answer()
        if self.held.get(name) == member:
            del self.held[name]

    async def mark(self, name: str) -> None:
        self._answer()
        self.marks.add(name)

    async def unmark(self, name: str) -> None:
        self._answer()
        self.marks.discard(name)

    async def marked(self, name: str) -> bool:
        self._answer()
        return name in self.marks

    def expire(self, member: str) -> None:
        """``member`` died: its leases and counts run out."""
        for name in [name for name, holder in self.held.items() if holder == member]:
            del self.held[name]
        for members in self.counted.values():
            members.discard(member)


@dataclass
class Stage:
    """What :class:`Partitions` reads of a stage."""

    name: str = "orders@g"
    pattern: str = "orders"
    group: str = "g"
    deliveries: dict[int, Any] = field(default_factory=dict)
    handlings: list[Any] = field(default_factory=list)
    retrying: dict[int, Envelope] = field(default_factory=dict)


@dataclass
class Delivery:
    envelope: Envelope


@dataclass
class Handling:
    envelope: Envelope | None


class View:
    """A replica's way to the shared :class:`Leases`: a dead replica's asks nothing."""

    def __init__(self, leases: Leases) -> None:
        self.leases = leases
        self.frozen = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.leases, name)

        async def call(*args: Any) -> Any:
            if self.frozen:
                await anyio.sleep_forever()
            return await method(*args)

        return call


class Replica:
    """A replica's :class:`Partitions`, run with a serve that records who reads what."""

    def __init__(self, leases: Leases, reading: dict[int, list[str]], name: str) -> None:
        self.stage = Stage()
        self.partitions = Partitions(self.stage, COUNT)
        self.leases = leases
        self.view = View(leases)
        self.reading = reading
        self.name = name
        self.scope = anyio.CancelScope()
        self.waits: list[float] = []

    async def serve(self, index: int, group: str, tap: Any) -> None:
        assert group == f"g#{index}/{COUNT}"
        tap.subscribed.set()
        self.reading[index].append(self.name)
        try:
            await anyio.sleep_forever()
        finally:
            self.reading[index].remove(self.name)

    async def run(self, settle_wait: float = 0.0) -> None:
        with self.scope:
            store: PartitionLeases = self.view  # type: ignore[assignment]
            await self.partitions.run(store, self.serve, settle_wait, [], anyio.Event())

    @property
    def owned(self) -> list[int]:
        return self.partitions.owned


def keyed(key: str, payload: int) -> Envelope:
    return Envelope(topic="orders", payload=payload, headers={HEADER_KEY: key})


async def until(condition: Any) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


def shares(*replicas: Replica) -> list[int]:
    return sorted(len(replica.owned) for replica in replicas)


async def test_replicas_share_the_partitions_and_no_partition_is_read_twice() -> None:
    leases = Leases()
    reading: dict[int, list[str]] = defaultdict(list)
    a, b, c = (Replica(leases, reading, name) for name in "abc")
    async with anyio.create_task_group() as group:
        group.start_soon(a.run)
        await until(lambda: a.owned == [0, 1, 2, 3])
        group.start_soon(b.run)
        await until(lambda: shares(a, b) == [2, 2])
        group.start_soon(c.run)
        await until(lambda: shares(a, b, c) == [1, 1, 2])
        assert sorted(a.owned + b.owned + c.owned) == [0, 1, 2, 3]
        assert all(len(readers) <= 1 for readers in reading.values())
        b.scope.cancel()  # b leaves: it gives its partitions back, the others take them
        await until(lambda: shares(a, c) == [2, 2])
        assert sorted(a.owned + c.owned) == [0, 1, 2, 3]
        await until(lambda: all(len(reading[i]) == 1 for i in range(COUNT)))
        group.cancel_scope.cancel()
    assert leases.held == {}  # every replica that left gave its leases back
    assert not any(leases.counted.values())


async def test_a_dead_replicas_partitions_are_taken_after_its_leases_run_out_and_read_later() -> (
    None
):
    leases = Leases()
    reading: dict[int, list[str]] = defaultdict(list)
    a, b = Replica(leases, reading, "a"), Replica(leases, reading, "b")
    async with anyio.create_task_group() as group:
        group.start_soon(a.run)
        group.start_soon(b.run, 0.3)
        await until(lambda: shares(a, b) == [2, 2])
        dead = set(a.owned)
        a.view.frozen = True  # it dies: it asks the broker nothing more
        a.scope.cancel()
        await until(lambda: all(reading[i] == [] for i in dead))
        leases.expire(a.partitions.instance)  # its leases run out; its marks stay
        began = anyio.current_time()
        await until(lambda: b.owned == [0, 1, 2, 3])
        await until(lambda: all(reading[i] == ["b"] for i in dead))
        # The marked partitions were read only after the transport's ack_timeout.
        assert anyio.current_time() - began >= 0.3
        group.cancel_scope.cancel()


async def test_a_lease_found_lost_stops_its_partition_at_once_and_gives_back_what_it_took_in() -> (
    None
):
    leases = Leases()
    reading: dict[int, list[str]] = defaultdict(list)
    a = Replica(leases, reading, "a")
    async with anyio.create_task_group() as group:
        group.start_soon(a.run)
        await until(lambda: a.owned == [0, 1, 2, 3])
        keys = {partition_of(keyed(f"k{k}", 0), COUNT): f"k{k}" for k in range(20)}
        taken = keyed(keys[2], 1)
        running = keyed(keys[2], 3)  # being handled: not reached by the guard again
        other = keyed(keys[1], 2)
        a.stage.deliveries = {id(e): Delivery(e) for e in (taken, running, other)}
        a.stage.handlings = [Handling(running), Handling(None)]
        leases.held[a.partitions._lease(2)] = "someone else"  # it ran out, and was taken
        await until(lambda: 2 not in a.owned)
        assert a.partitions.given_back == {taken.id}
        await until(lambda: reading[2] == [])
        group.cancel_scope.cancel()


async def test_a_broker_that_stops_answering_stops_every_partition_before_the_leases_run_out() -> (
    None
):
    leases = Leases()
    reading: dict[int, list[str]] = defaultdict(list)
    a = Replica(leases, reading, "a")
    async with anyio.create_task_group() as group:
        group.start_soon(a.run)
        await until(lambda: a.owned == [0, 1, 2, 3])
        leases.down = True
        began = anyio.current_time()
        await until(lambda: not a.owned)
        stopped_after = anyio.current_time() - began
        assert stopped_after < partitions_module.LEASE
        await until(lambda: all(readers == [] for readers in reading.values()))
        leases.down = False  # back: the partitions are taken again
        await until(lambda: a.owned == [0, 1, 2, 3])
        group.cancel_scope.cancel()


async def test_another_count_recorded_in_the_broker_is_refused() -> None:
    partitions = Partitions(Stage(), COUNT)
    with pytest.raises(ConfigurationError, match="split into 8 partitions"):
        await partitions.run(Leases(), None, 0.0, [("orders", "g#3/8")], None)  # type: ignore[arg-type]


def test_names_and_the_hash() -> None:
    envelope = keyed("order-7", 1)
    assert partition_of(envelope, 8) == zlib.crc32(b"order-7") % 8
    keyless = Envelope(topic="orders", payload=1)
    assert partition_of(keyless, 8) == zlib.crc32(keyless.id.encode()) % 8
    assert partition_group("g", 3, 8) == "g#3/8"
    assert split_partition_group("a#b#3/8") == ("a#b", 3, 8)
    assert split_partition_group("g#8/8") is None
    assert split_partition_group("g") is None
    assert fold_partitions(("o@g#0/2", "o@g#1/2", "p@h")) == ("o@g", "p@h")
    same = ("o@g", "p@h")
    assert fold_partitions(same) is same
