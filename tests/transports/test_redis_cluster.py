"""RedisTransport on a Redis Cluster (``cluster=True``): the conformance suite, a bus
end to end, and the master of the bus's slot killed under a running bus.

The cluster is the module's own (:class:`RedisClusterNodes`: three masters with a
replica each on private loopback ports, a replica promoted 2-3 s after its master
dies). A prefix's shared keys carry the hash tag ``{prefix}``; each binding's stream
and delayed retries carry one of their own, so a bus's bindings spread over the
masters.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from _brokers import publish_verbatim  # type: ignore[import-not-found]
from _failover import LoadThroughAFault  # type: ignore[import-not-found]
from _private_brokers import RedisClusterNodes  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, Envelope, Retry, TransportError
from asyncbus.testing.transport_suite import TransportSuite
from asyncbus.transports import Delivery, Transport
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.timeout(120)]

ACK_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """The module's Redis Cluster (started once: about 3 s)."""
    pytest.importorskip("redis")
    with RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster")) as nodes:
        yield nodes


async def _forget(urls: list[str], prefix: str) -> None:
    """Delete every key of ``prefix`` (its shared keys' and its bindings')."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    port = int(urls[0].rsplit(":", 1)[1])
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port)])
    try:
        async for key in client.scan_iter(match=f"{{{prefix}[:}}]*"):
            await client.delete(key)
    finally:
        await client.aclose()


@pytest.fixture
async def prefix(cluster: RedisClusterNodes) -> AsyncIterator[str]:
    """A prefix of the test's own, its keys deleted after it."""
    name = f"c{uuid.uuid4().hex[:10]}"
    yield name
    with anyio.CancelScope(shield=True):
        await _forget(cluster.urls, name)


class TestRedisCluster(TransportSuite):
    """RedisTransport on a Redis Cluster passes the conformance suite."""

    ack_timeout = ACK_TIMEOUT

    @pytest.fixture
    async def transport(self, cluster: RedisClusterNodes, prefix: str) -> AsyncIterator[Transport]:
        async with RedisTransport(
            cluster.urls, prefix=prefix, ack_timeout=self.ack_timeout, cluster=True
        ) as transport:
            yield transport

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        await publish_verbatim(transport, topic, body)


async def test_a_bus_runs_on_the_cluster_end_to_end(
    cluster: RedisClusterNodes, prefix: str
) -> None:
    """Publish, fan out to two groups and retry: on a cluster, as on one server."""
    bus = Bus(transport=RedisTransport(cluster.urls, prefix=prefix, cluster=True))
    seen: dict[str, list[int]] = {"a": [], "b": []}
    failed_once: set[int] = set()
    done = anyio.Event()

    @bus.subscribe("orders.*", group="a", retry=Retry(max_attempts=2))
    async def first(n: int) -> None:
        if n % 5 == 0 and n not in failed_once:
            failed_once.add(n)
            raise RuntimeError("once")
        seen["a"].append(n)
        if len(seen["a"]) == 20 and len(seen["b"]) == 20:
            done.set()

    @bus.subscribe("orders.*", group="b")
    async def second(n: int) -> None:
        seen["b"].append(n)
        if len(seen["a"]) == 20 and len(seen["b"]) == 20:
            done.set()

    with anyio.fail_after(60):
        async with bus:
            for n in range(20):
                await bus.publish("orders.created", n)
            await done.wait()
            await bus.drain(10)
    assert sorted(seen["a"]) == list(range(20))
    assert sorted(seen["b"]) == list(range(20))
    assert failed_once == {0, 5, 10, 15}


async def _added_on(port: int, key: str) -> int:
    """How many entries were ever added to stream ``key`` on the node at ``port`` (a
    replica answers reads once told ``READONLY``)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=port, single_connection_client=True)
    try:
        await client.execute_command("READONLY")
        return int((await client.xinfo_stream(key))["entries-added"])
    finally:
        await client.aclose()


async def test_wait_replicas_on_a_cluster_waits_for_the_replica_of_the_slots_master(
    cluster: RedisClusterNodes, prefix: str
) -> None:
    """``wait_replicas=1`` with ``cluster=True``: each publish (and a write to one group)
    returns once the replica of the master holding the group's stream has it; with that
    replica
    stopped (connected, silent) each raises in time, the envelope on the master all the
    same."""
    transport = RedisTransport(
        cluster.urls, prefix=prefix, cluster=True, wait_replicas=1, publish_timeout=1.0
    )
    bus = Bus(transport=transport)
    handled: list[int] = []
    stream = transport.stream_key("jobs", "workers")
    master = await anyio.to_thread.run_sync(cluster.master_of, stream)
    [replica] = await anyio.to_thread.run_sync(cluster.replicas_of, master)

    @bus.subscribe("jobs", group="workers", concurrency=1, capacity=64)
    async def work(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(60):
        async with bus:
            for n in range(3):
                await bus.publish("jobs", n)
                assert await _added_on(replica, stream) == n + 1  # the replica has it
            await transport.publish_to_group("jobs", "workers", [Envelope(topic="jobs", payload=3)])
            assert await _added_on(replica, stream) == 4
            cluster.pause(replica)
            try:
                for publish in (
                    lambda: bus.publish("jobs", 4),
                    lambda: transport.publish_to_group(
                        "jobs", "workers", [Envelope(topic="jobs", payload=5)]
                    ),
                ):
                    began = anyio.current_time()
                    with pytest.raises(TransportError, match="on 0 of the 1 replicas"):
                        await publish()
                    took = anyio.current_time() - began
                    assert took <= 1.0 + 0.5, f"the publish took {took:.2f} s to fail"
            finally:
                cluster.resume(replica)
            await bus.drain(10)
        await anyio.to_thread.run_sync(cluster.wait_settled)
    assert sorted(handled) == [0, 1, 2, 3, 4, 5]  # on the master all the same


def test_several_urls_without_cluster_and_braces_in_a_cluster_prefix_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="cluster=True"):
        RedisTransport("redis://127.0.0.1:7000,redis://127.0.0.1:7001")
    with pytest.raises(ConfigurationError, match="braces"):
        RedisTransport(["redis://127.0.0.1:7000"], prefix="a{b}", cluster=True)
    with pytest.raises(ConfigurationError, match="database 0"):
        RedisTransport("redis://127.0.0.1:7000/3", cluster=True)
    with pytest.raises(ConfigurationError, match="must be a bool"):
        RedisTransport("redis://127.0.0.1:7000", cluster="yes")  # type: ignore[arg-type]
    shown = RedisTransport(
        ["redis://:secret@127.0.0.1:7000", "redis://:secret@127.0.0.1:7001"], cluster=True
    )
    assert shown.url.count("secret") == 2 and "secret" not in shown._shown()


async def test_the_master_of_the_groups_stream_killed_under_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Publishers running (100 in flight) when the master holding the group's stream is
    killed: publishes fail with ``TransportError`` (never hang) until its replica took
    over, the same bus goes on without a restart (and once the killed node is back, as a
    replica, each new publish is handled once), and every confirmed publish is
    accounted for: delivered, or lost with the writes the master had not yet passed to
    its replica (Redis replicates asynchronously: a number printed here), which can only
    be those confirmed in the last moment before the kill."""
    with RedisClusterNodes(tmp_path) as nodes:
        name = f"c{uuid.uuid4().hex[:10]}"
        transport = RedisTransport(
            nodes.urls, prefix=name, cluster=True, ack_timeout=2.0, publish_timeout=3.0
        )
        bus = Bus(transport=transport)
        load = LoadThroughAFault(bus)

        victim: list[int] = []

        async def kill_the_master() -> None:
            victim.append(nodes.master_of(transport.stream_key("jobs", "workers")))
            nodes.kill(victim[0])

        with anyio.fail_after(100):
            async with bus:
                await load.run(kill_the_master)
                # After the election: the same bus publishes and handles again.
                await anyio.to_thread.run_sync(nodes.wait_settled)
                settled_at = anyio.current_time()
                marker_in = await load.handled_again(settled_at)
                await bus.drain(30)
                # The killed node comes back (a replica of its successor now).
                nodes.start_node(victim[0])
                await anyio.to_thread.run_sync(nodes.wait_settled)
                assert await load.after_return() == [1] * 100
        with capsys.disabled():
            print(load.summary("Redis Cluster, the master of the group's stream killed", marker_in))
        lost = set(load.confirmed) - load.delivered
        assert len(load.confirmed) + len(load.failed) == load.total
        assert load.delivered <= set(load.confirmed) | load.failed  # only what was published
        # The replica had everything confirmed a second before the kill, and whatever
        # was confirmed after the election is on the new master.
        assert {n for n in lost if load.confirmed[n] < load.fault_at - 1.0} == set()
        assert {n for n in lost if load.confirmed[n] > settled_at} == set()
        assert max(load.took) <= 3.0 * 2 + 1.0  # a publish fails in time, never hangs
        assert load.resumed_in() <= 2.0 + 10.0  # ack_timeout + 10 s
        assert marker_in <= 3.0 + 10.0


@pytest.mark.timeout(60)
def test_a_node_whose_port_was_taken_before_it_started_moves_to_a_free_one(
    tmp_path: Path,
) -> None:
    """The test clusters choose free ports before starting their nodes; another process
    may take one in between (an outgoing connection, on this shared machine): that node
    exits at once and is started on fresh ports, and the cluster still forms."""
    nodes = RedisClusterNodes(tmp_path, masters=3, replicas=0)
    taken = nodes.ports[1]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))  # (bound, not listening: as a client's port)
        with nodes:
            assert taken not in nodes.ports and len(set(nodes.ports)) == 3
            nodes.wait_settled()
            assert len(nodes.urls) == 3


async def _keys_on(port: int, keys: list[str]) -> int:
    """How many of ``keys`` the node at ``port`` holds itself."""
    import redis.asyncio as aioredis

    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        return sum([int(await client.exists(key)) for key in keys])
    finally:
        await client.aclose()


async def test_a_bus_spreads_its_groups_over_every_master(
    cluster: RedisClusterNodes, prefix: str
) -> None:
    """Groups whose streams hash to each of the three masters: each group's stream is on
    its master (not all on the prefix's); a publish fanned out to all of them reaches
    each once; a delayed retry and a dead letter of a group on another master than the
    prefix's shared keys come back and are kept as on one server."""
    transport = RedisTransport(cluster.urls, prefix=prefix, cluster=True)
    masters = await anyio.to_thread.run_sync(cluster.live_masters)
    assert len(masters) == 3
    # A group on each master: names tried in order until each master has one.
    groups: dict[int, str] = {}
    for n in range(200):
        name = f"g{n}"
        master = await anyio.to_thread.run_sync(
            cluster.master_of, transport.stream_key("orders.*", name)
        )
        groups.setdefault(master, name)
        if len(groups) == 3:
            break
    assert sorted(groups) == sorted(masters)
    bus = Bus(transport=transport)
    handled: dict[str, list[int]] = {name: [] for name in groups.values()}
    failed_once: set[tuple[str, int]] = set()

    def subscribe(name: str) -> None:
        @bus.subscribe(
            "orders.*", group=name, retry=Retry(max_attempts=2, backoff=0.05, jitter=False)
        )
        async def handle(n: int) -> None:
            if n == 9:
                raise ValueError("never")  # dead-lettered after its retry
            if n % 4 == 0 and (name, n) not in failed_once:
                failed_once.add((name, n))
                raise RuntimeError("once")  # a delayed retry, handled the second time
            handled[name].append(n)

    for name in groups.values():
        subscribe(name)
    with anyio.fail_after(60):
        async with bus:
            for n in range(10):
                await bus.publish("orders.created", n)
            await bus.drain(30)
            dead = bus.dead_letters.list()
            stored = await transport.dead_letters()
    for name in groups.values():
        assert sorted(handled[name]) == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert failed_once == {(name, n) for name in groups.values() for n in (0, 4, 8)}
    every_group = sorted(f"orders.*@{name}" for name in groups.values())
    assert sorted(entry.stage for entry in dead) == every_group
    assert sorted(entry.stage for entry in stored) == every_group
    for master, name in groups.items():
        assert await _keys_on(master, [transport.stream_key("orders.*", name)]) == 1


@asynccontextmanager
async def _one_delivered(
    transport: RedisTransport,
) -> AsyncIterator[tuple[Delivery, AsyncIterator[Delivery]]]:
    """``transport`` connected and subscribed to ``jobs`` (group ``g``), one envelope
    published: its delivery, and the deliveries to come."""
    async with transport, transport.subscribe("jobs", group="g", prefetch=1) as deliveries:
        await transport.publish("jobs", [Envelope(topic="jobs", payload=1)])
        yield await anext(deliveries), deliveries


async def test_a_delayed_retry_left_out_of_the_index_is_found_by_the_repair(
    cluster: RedisClusterNodes, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delayed retry whose binding the index of due bindings does not name (its
    process killed between writing it and naming it, or the index's master failed over
    without the entry: here the index deleted) comes back all the same: the mover's
    repair looks at every binding's first retry."""
    from asyncbus.transports import _redis_delayed

    monkeypatch.setattr(_redis_delayed, "_REPAIR_EVERY", 0.5)
    transport = RedisTransport(cluster.urls, prefix=prefix, cluster=True)
    with anyio.fail_after(30):
        async with _one_delivered(transport) as (first, deliveries):
            await first.nack(delay=0.3)
            await transport._redis().delete(transport._delayed_index_key)
            again = await anext(deliveries)
            assert (again.envelope.id, again.envelope.attempt) == (first.envelope.id, 2)
            await again.ack()


async def test_with_wait_replicas_a_dead_letter_is_on_a_replica_before_the_settle(
    cluster: RedisClusterNodes, prefix: str
) -> None:
    """On a cluster the dead letters and a group's stream are on different slots: with
    ``wait_replicas=1`` a reject whose dead letter the replica of its master does not
    confirm raises and leaves the delivery unsettled (it comes again), instead of acking
    it on the group's master with the dead letter only on a master that may fail over."""
    transport = RedisTransport(
        cluster.urls,
        prefix=prefix,
        cluster=True,
        wait_replicas=1,
        publish_timeout=1.0,
        ack_timeout=1.0,
    )
    master = await anyio.to_thread.run_sync(cluster.master_of, f"{{{prefix}}}:deadletters")
    [replica] = await anyio.to_thread.run_sync(cluster.replicas_of, master)
    with anyio.fail_after(60):
        async with _one_delivered(transport) as (delivery, deliveries):
            cluster.pause(replica)
            try:
                with pytest.raises(TransportError, match="on 0 of the 1 replicas"):
                    await delivery.reject("rejected")
            finally:
                cluster.resume(replica)
            assert await transport.backlog("jobs", "g") == 1  # not settled
            again = await anext(deliveries)  # after ack_timeout
            assert again.envelope.id == delivery.envelope.id
            await again.reject("rejected")
            stored = await transport.dead_letters()
    # The first try's dead letter is on the master all the same: the entry twice.
    assert [entry.envelope.payload for entry in stored] == [1, 1]


@pytest.mark.timeout(120)
def test_the_fanout_benchmark_accounts_for_every_publish(
    cluster: RedisClusterNodes, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench fanout``, a short run: every group's stream holds each publish once, on
    one server and on the cluster, and three groups are on three masters."""
    import cluster_fanout  # (benchmarks/ is on pytest's pythonpath)

    nodes = ",".join(cluster.urls)
    arguments = ["--redis", redis_url, "--redis-cluster", nodes, "--messages", "300"]
    assert cluster_fanout.main([*arguments, "--rounds", "1", "--groups", "1,3", "--check"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert len(rows) == 1 and rows[0].endswith("| 3 |")
