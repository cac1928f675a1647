"""``subscribe(ordering="key", partitions=N)`` over every broker: the group's partitions
are shared among its replicas, one replica per partition at a time, so each key's
envelopes are handled one at a time, in publish order, by whichever replica serves its
partition; a replica that leaves hands its partitions over, one that joins takes its
share; a transport that keeps no leases refuses partitions at ``subscribe``."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, Envelope, Reject, Retry
from asyncbus._leases import PartitionLeases
from asyncbus._partitions import LeasedPartitions
from asyncbus.transports import LeaseStoreProvider, PartitionLeasesProvider

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


PARTITIONS = 4


@dataclass
class Record:
    """Every handling of every replica: (key, sequence, replica, start, end)."""

    spans: list[tuple[int, int, str, float, float]] = field(default_factory=list)
    running: dict[int, str] = field(default_factory=dict)
    overlaps: list[tuple[int, str, str]] = field(default_factory=list)

    def handled(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = defaultdict(list)
        for key, n, _, _, _ in sorted(self.spans, key=lambda span: span[3]):
            found[key].append(n)
        return found

    def replicas_of(self, key: int) -> set[str]:
        return {replica for k, _, replica, _, _ in self.spans if k == key}


def replica(
    kind: str, url: str, prefix: str, name: str, record: Record, *, pause: float = 0.001, **options
) -> Bus:
    bus = Bus(transport=make_transport(kind, url, prefix), name=name)

    @bus.subscribe(
        "orders", group="g", concurrency=8, ordering="key", partitions=PARTITIONS, **options
    )
    async def handle(envelope: Envelope) -> None:
        key, n = envelope.payload
        other = record.running.get(key)
        if other is not None:
            record.overlaps.append((key, other, name))
        record.running[key] = name
        began = anyio.current_time()
        try:
            await anyio.sleep(pause)
            if envelope.headers.get("fail") == "always":
                raise Reject("bad order")
            if envelope.headers.get("fail") == "once" and envelope.attempt == 1:
                raise RuntimeError("transient")
        finally:
            del record.running[key]
        record.spans.append((key, n, name, began, anyio.current_time()))

    return bus


async def publish(bus: Bus, keys: int, each: int, start: int = 0, **headers: str) -> None:
    for n in range(start, start + each):
        for k in range(keys):
            await bus.publish("orders", [k, n], key=f"order-{k}", headers=headers or None)


def partitions_owned(*buses: Bus) -> list[int]:
    return [bus.statistics().stage("orders@g").partitions_owned for bus in buses]


async def test_two_replicas_share_the_partitions_and_keep_each_keys_order(
    kind: str, url: str, unique_prefix: str
) -> None:
    record = Record()
    first = replica(kind, url, unique_prefix, "a", record)
    second = replica(kind, url, unique_prefix, "b", record)
    keys, each = 12, 15
    with anyio.fail_after(75):
        async with first, second:
            while partitions_owned(first, second) != [2, 2]:
                await anyio.sleep(0.05)
            await publish(first, keys, each)
            while len(record.spans) < keys * each:
                await anyio.sleep(0.01)
            await first.drain(timeout=10)
            await second.drain(timeout=10)
            stages = [bus.statistics().stage("orders@g") for bus in (first, second)]
    assert record.overlaps == []
    assert record.handled() == {k: list(range(each)) for k in range(keys)}
    for k in range(keys):
        assert len(record.replicas_of(k)) == 1, k
    # Every envelope counted once, by the replica serving its partition.
    assert sum(stage.published for stage in stages) == keys * each
    assert sum(stage.acked for stage in stages) == keys * each
    assert all(stage.published > 0 for stage in stages)


async def test_one_replica_serves_every_partition_and_receipts_name_the_group(
    kind: str, url: str, unique_prefix: str
) -> None:
    record = Record()
    bus = replica(kind, url, unique_prefix, "a", record, retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(45):
        async with bus:
            assert partitions_owned(bus) == [PARTITIONS]
            receipt = await bus.publish("orders", [0, 0], key="order-0")
            await publish(bus, 3, 4, start=1, fail="once")
            await publish(bus, 1, 1, start=5, fail="always")
            await publish(bus, 3, 2, start=6)
            await bus.drain(timeout=20)
            stage = bus.statistics().stage("orders@g")
            dead = [entry.envelope.payload for entry in bus.dead_letters.list()]
    assert receipt.accepted == ("orders@g",)
    assert record.overlaps == []
    assert record.handled() == {
        0: [0, 1, 2, 3, 4, 6, 7],
        1: [1, 2, 3, 4, 6, 7],
        2: [1, 2, 3, 4, 6, 7],
    }
    assert dead == [[0, 5]]
    total = 1 + 12 + 1 + 6
    assert (stage.published, stage.acked, stage.dead_lettered) == (total, total - 1, 1)
    assert stage.retried == 12
    assert (stage.depth, stage.in_flight, stage.keys_held) == (0, 0, 0)


async def test_a_replica_that_joins_takes_its_share_and_one_that_leaves_hands_it_over(
    kind: str, url: str, unique_prefix: str
) -> None:
    record = Record()
    first = replica(kind, url, unique_prefix, "a", record, pause=0.005)
    second = replica(kind, url, unique_prefix, "b", record, pause=0.005)
    keys = 8
    with anyio.fail_after(80):
        async with first:
            assert partitions_owned(first) == [PARTITIONS]
            await publish(first, keys, 10)
            async with second:  # joins while the first has work under way
                await publish(first, keys, 10, start=10)
                while partitions_owned(first, second) != [2, 2]:
                    await anyio.sleep(0.05)
                await publish(first, keys, 10, start=20)
                while len(record.spans) < keys * 30:
                    await anyio.sleep(0.01)
            # The second left: its partitions come back to the first.
            while partitions_owned(first) != [PARTITIONS]:
                await anyio.sleep(0.05)
            await publish(first, keys, 10, start=30)
            await first.drain(timeout=10)
            stage = first.statistics().stage("orders@g")
    assert record.overlaps == []
    assert record.handled() == {k: list(range(40)) for k in range(keys)}
    # No key ran on two replicas at once: each replica's spans of a key end before the
    # other's begin, in the order the partition changed hands.
    for k in range(keys):
        spans = sorted((s for s in record.spans if s[0] == k), key=lambda s: s[3])
        for before, after in pairwise(spans):
            assert before[4] <= after[3], (k, before, after)
    assert stage.partitions_owned == PARTITIONS
    assert (stage.depth, stage.in_flight) == (0, 0)


async def test_another_partition_count_for_the_same_group_is_refused(
    kind: str, url: str, unique_prefix: str
) -> None:
    first = Bus(transport=make_transport(kind, url, unique_prefix))
    first.subscribe("orders", lambda n: None, group="g", ordering="key", partitions=4)
    second = Bus(transport=make_transport(kind, url, unique_prefix))
    second.subscribe("orders", lambda n: None, group="g", ordering="key", partitions=3)
    with anyio.fail_after(45):
        async with first:
            with pytest.raises(ConfigurationError, match="split into 4 partitions"):
                async with second:
                    pass


async def test_replay_goes_to_the_partition_of_the_envelope(
    kind: str, url: str, unique_prefix: str
) -> None:
    failing = True
    handled: list[int] = []
    bus = Bus(transport=make_transport(kind, url, unique_prefix))

    @bus.subscribe("orders", group="g", ordering="key", partitions=PARTITIONS)
    async def handle(n: int) -> None:
        if failing:
            raise Reject("not yet")
        handled.append(n)

    with anyio.fail_after(45):
        async with bus:
            await bus.publish("orders", 7, key="order-7")
            await bus.drain(timeout=10)
            (entry,) = bus.dead_letters.list()
            failing = False
            (receipt,) = await bus.dead_letters.replay(entry)
            await bus.drain(timeout=10)
            stage = bus.statistics().stage("orders@g")
    assert handled == [7]
    assert receipt.accepted == ("orders@g",)
    assert (stage.published, stage.acked, stage.dead_lettered) == (2, 1, 1)


async def test_partitions_are_refused_over_a_transport_without_leases() -> None:
    from test_protocol_only_transport import ProtocolTransport  # type: ignore[import-not-found]

    bus = Bus(transport=ProtocolTransport())

    async def handle(n: int) -> None:
        pass

    with pytest.raises(ConfigurationError, match="this transport keeps no leases"):
        bus.subscribe("orders", handle, ordering="key", partitions=8)
    assert bus.statistics().stages == ()


def partition_leases(transport: object) -> PartitionLeases:
    if isinstance(transport, PartitionLeasesProvider):
        return transport.partition_leases()
    assert isinstance(transport, LeaseStoreProvider)
    return LeasedPartitions(transport.lease_store())


async def test_the_leases_of_partitions_are_exclusive_counted_and_marked(
    kind: str, url: str, unique_prefix: str
) -> None:
    one = make_transport(kind, url, unique_prefix)
    two = make_transport(kind, url, unique_prefix)
    with anyio.fail_after(30):
        async with one, two:
            first, second = partition_leases(one), partition_leases(two)
            assert await first.take("p0", "a") is True
            assert await first.take("p0", "a") is True  # its own: still its
            assert await second.take("p0", "b") is False
            assert (await first.keep("p0", "a"), await second.keep("p0", "b")) == (True, False)
            await second.give("p0", "b")  # not its own: nothing changes
            assert await second.take("p0", "b") is False
            await first.give("p0", "a")
            assert await second.take("p0", "b") is True
            assert await first.keep("p0", "a") is False
            assert await first.count("members") == 0
            assert await first.count_in("members", "a") == 1
            assert await second.count_in("members", "b") == 2
            assert await first.count_in("members", "a") == 2  # counted once
            await first.count_out("members", "a")
            assert await second.count("members") == 1
            await first.mark("m0")
            marked = await second.marked("m0")
            await first.unmark("m0")
            assert await second.marked("m0") is False
        # A lease goes with its holder's connection over RabbitMQ, and after its renewals
        # stop elsewhere: the marks are kept by the brokers that need them.
        assert marked is (kind != "rabbit")


async def test_a_bus_stopped_mid_key_leaves_the_rest_to_the_next_in_order(
    kind: str, url: str, unique_prefix: str
) -> None:
    record = Record()
    keys, each = 4, 12
    first = replica(kind, url, unique_prefix, "a", record, pause=0.02)
    with anyio.fail_after(60):
        async with first:
            await publish(first, keys, each)
            while len(record.spans) < 10:
                await anyio.sleep(0.01)
            report = await first.aclose(timeout=0)  # at once: what is left is given back
        assert report.abandoned  # envelopes were waiting for their keys
        second = replica(kind, url, unique_prefix, "b", record)
        async with second:
            while len(record.spans) < keys * each:
                await anyio.sleep(0.01)
            await second.drain(timeout=10)
            stage = second.statistics().stage("orders@g")
    assert record.overlaps == []
    # What the first bus finished is not handled again; the rest follows, in order.
    assert record.handled() == {k: list(range(each)) for k in range(keys)}
    first_handled = sum(1 for span in record.spans if span[2] == "a")
    assert stage.acked == keys * each - first_handled
