"""RedisTransport on a Redis Cluster (``cluster=True``): the conformance suite, a bus
end to end, and the master of the bus's slot killed under a running bus.

The cluster is the module's own (:class:`RedisClusterNodes`: three masters with a
replica each on private loopback ports, a replica promoted 2-3 s after its master
dies). Every key of one prefix carries the hash tag ``{prefix}``: one slot, so one
master and its replica hold a bus; several prefixes spread over the masters.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest
from _brokers import publish_verbatim  # type: ignore[import-not-found]
from _failover import LoadThroughAFault  # type: ignore[import-not-found]
from _private_brokers import RedisClusterNodes  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, Envelope, Retry, TransportError
from asyncbus.testing.transport_suite import TransportSuite
from asyncbus.transports import Transport
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
    """Delete every key of ``prefix`` (all in the slot of its hash tag)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    port = int(urls[0].rsplit(":", 1)[1])
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port)])
    try:
        async for key in client.scan_iter(match=f"{{{prefix}}}:*"):
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
    returns once the replica of the master holding the prefix has it; with that replica
    stopped (connected, silent) each raises in time, the envelope on the master all the
    same."""
    transport = RedisTransport(
        cluster.urls, prefix=prefix, cluster=True, wait_replicas=1, publish_timeout=1.0
    )
    bus = Bus(transport=transport)
    handled: list[int] = []
    stream = transport.stream_key("jobs", "workers")
    master = await anyio.to_thread.run_sync(cluster.master_of, f"{{{prefix}}}")
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


async def test_the_master_of_the_bus_slot_killed_under_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Publishers running (100 in flight) when the master holding the bus's slot is
    killed: publishes fail with ``TransportError`` (never hang) until its replica took
    over, the same bus goes on without a restart (and once the killed node is back, as a
    replica, each new publish is handled once), and every confirmed publish is
    accounted for: delivered, or lost with the writes the master had not yet passed to
    its replica (Redis replicates asynchronously: a number printed here), which can only
    be those confirmed in the last moment before the kill."""
    with RedisClusterNodes(tmp_path) as nodes:
        name = f"c{uuid.uuid4().hex[:10]}"
        bus = Bus(
            transport=RedisTransport(
                nodes.urls, prefix=name, cluster=True, ack_timeout=2.0, publish_timeout=3.0
            )
        )
        load = LoadThroughAFault(bus)

        victim: list[int] = []

        async def kill_the_master() -> None:
            victim.append(nodes.master_of(f"{{{name}}}"))
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
            print(load.summary("Redis Cluster, the bus's master killed", marker_in))
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
