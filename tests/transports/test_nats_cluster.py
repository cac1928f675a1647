"""NATS as a cluster: a transport given every node's URL, streams and buckets replicated
``replicas`` times, and a node killed under a running bus without losing what the
cluster confirmed. Three private nats-servers form a JetStream cluster on loopback."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from _brokers import forget  # type: ignore[import-not-found]
from _failover import LoadThroughAFault  # type: ignore[import-not-found]
from _private_brokers import (  # type: ignore[import-not-found]
    PrivateServer,
    free_port,
    private_nats_cluster,
)

from asyncbus import Bus, ConfigurationError, ConnectError, Envelope, TransportError
from asyncbus.testing.transport_suite import TransportSuite
from asyncbus.transports import Transport
from asyncbus.transports._codec import envelope_to_wire
from asyncbus.transports.nats import HEADER_META, NatsTransport

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.timeout(120)]


async def _ready(make: Callable[[], NatsTransport]) -> None:
    """Wait until the new cluster elected its JetStream leaders: a transport made by
    ``make`` connects (and is closed again). Not inside a cancel scope: a transport's
    task group stays open in the task that connected it until it closes."""
    deadline = anyio.current_time() + 30
    while True:
        probe = make()
        try:
            await probe.connect()
        except ConnectError as error:
            if "replicas" in str(error) or anyio.current_time() > deadline:
                raise
            await anyio.sleep(0.2)
        else:
            await probe.aclose()
            return


@pytest.fixture(scope="module")
async def shared_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[list[PrivateServer]]:
    """A three-node JetStream cluster for the module's conformance suite."""
    async with private_nats_cluster(tmp_path_factory.mktemp("nats-cluster")) as nodes:
        yield nodes


class TestNatsCluster(TransportSuite):
    """NatsTransport on a three-node cluster, its streams and buckets R3, passes the
    conformance suite."""

    ack_timeout = 2.0
    #: The server's max_payload is 1 MiB (headers and body together).
    large_payload_size = (1 << 20) - 4096

    @pytest.fixture
    async def transport(
        self, shared_cluster: list[PrivateServer], unique_prefix: str
    ) -> AsyncIterator[Transport]:
        urls = [node.url for node in shared_cluster]

        def make() -> NatsTransport:
            return NatsTransport(
                urls, prefix=unique_prefix, replicas=3, ack_timeout=self.ack_timeout
            )

        await _ready(make)
        transport = make()
        async with transport:
            yield transport
        with anyio.CancelScope(shield=True):
            await forget("nats", urls[0], unique_prefix)  # (any node will do)

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        assert isinstance(transport, NatsTransport)
        envelope = Envelope(topic=topic)
        meta, _ = envelope_to_wire(envelope, transport.codec)
        _, js = transport._client()
        await js.publish(
            f"{transport.prefix}.{topic}",
            body,
            headers={"Nats-Msg-Id": envelope.id, HEADER_META: meta.decode()},
        )


async def _stream_replicas(transport: NatsTransport, stream: str) -> tuple[int, str | None]:
    _, js = transport._client()
    info = await js.stream_info(stream)
    assert info.config.num_replicas is not None and info.cluster is not None
    return info.config.num_replicas, info.cluster.leader


async def test_a_bus_keeps_everything_through_the_loss_of_any_one_node(tmp_path: Path) -> None:
    async with private_nats_cluster(tmp_path) as nodes:
        urls = [node.url for node in nodes]
        prefix = f"c{uuid.uuid4().hex[:8]}"
        await _ready(lambda: NatsTransport(urls, prefix=prefix, replicas=3))
        transport = NatsTransport(urls, prefix=prefix, replicas=3)
        bus = Bus(transport=transport)
        handled: dict[int, int] = {}

        @bus.subscribe("orders", group="g", concurrency=4)
        async def handle(n: int) -> None:
            handled[n] = handled.get(n, 0) + 1

        with anyio.fail_after(90):
            async with bus:
                replicas, _ = await _stream_replicas(transport, transport.stream)
                assert replicas == 3
                for n in range(50):
                    await bus.publish("orders", n)
                await bus.drain()
                # kill -9 the stream's leader: the cluster elects another, and a client
                # connected to it moves to another node.
                _, leader = await _stream_replicas(transport, transport.stream)
                assert leader is not None
                await nodes[int(leader.removeprefix("n")) - 1].kill()
                for n in range(50, 100):
                    while True:
                        try:
                            await bus.publish("orders", n)
                            break
                        except TransportError:
                            await anyio.sleep(0.1)  # (while the cluster elects a leader)
                while len(handled) < 100:
                    await anyio.sleep(0.05)
                await bus.drain()
    assert sorted(handled) == list(range(100))


async def test_a_bus_started_while_its_streams_node_is_down_fails_with_a_clear_error(
    tmp_path: Path,
) -> None:
    async with private_nats_cluster(tmp_path) as nodes:
        urls = [node.url for node in nodes]
        await _ready(lambda: NatsTransport(urls, prefix="lone"))  # its streams: one copy
        probe = NatsTransport(urls, prefix="lone")
        await probe.connect()
        _, leader = await _stream_replicas(probe, probe.stream)
        await probe.aclose()
        assert leader is not None
        await nodes[int(leader.removeprefix("n")) - 1].kill()
        bus = Bus(transport=NatsTransport(urls, prefix="lone", request_timeout=1.0))
        with pytest.raises(ConnectError, match="stream LONE"):
            async with bus:
                pass


async def test_a_replica_count_the_cluster_cannot_hold_is_a_clear_error(tmp_path: Path) -> None:
    async with private_nats_cluster(tmp_path) as nodes:
        urls = [node.url for node in nodes]
        with pytest.raises((ConfigurationError, ConnectError), match="replicas=5"):
            await _ready(lambda: NatsTransport(urls, prefix="five", replicas=5))


async def test_a_stream_with_other_replicas_is_reported_not_reused(tmp_path: Path) -> None:
    async with private_nats_cluster(tmp_path) as nodes:
        urls = ",".join(node.url for node in nodes)  # one string, comma-separated
        await _ready(lambda: NatsTransport(urls, prefix="same", replicas=1))
        with pytest.raises(
            ConfigurationError, match=r"1 replica\(s\); this transport asks for replicas=3"
        ):
            await NatsTransport(urls, prefix="same", replicas=3).connect()


async def test_a_dead_first_url_is_skipped_and_every_url_is_redacted(tmp_path: Path) -> None:
    async with private_nats_cluster(tmp_path) as nodes:
        dead = f"nats://user:secret@127.0.0.1:{free_port()}"
        urls = [dead, *(node.url for node in nodes)]
        assert "secret" not in repr(NatsTransport(urls, prefix="skip"))
        await _ready(lambda: NatsTransport(urls, prefix="skip"))  # (connects past the dead one)


def test_replicas_are_checked_when_the_transport_is_made() -> None:
    for wrong in (0, 6, True, 1.5, "3"):
        with pytest.raises(
            ConfigurationError, match=r"NatsTransport: replicas must be an int >= 1 \(at most 5\)"
        ):
            NatsTransport("nats://127.0.0.1:4222", replicas=wrong)  # type: ignore[arg-type]


async def test_the_stream_leader_killed_under_load_loses_no_confirmed_publish(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Publishers running (100 in flight) when the stream's leader is killed: publishes
    fail with ``TransportError`` in time (never hang) during the election, the same bus
    goes on, every publish the cluster confirmed is handled (R3: nothing lost), and once
    the killed node is back each new publish is handled once."""
    async with private_nats_cluster(tmp_path) as nodes:
        urls = [node.url for node in nodes]
        prefix = f"c{uuid.uuid4().hex[:8]}"

        def make() -> NatsTransport:
            return NatsTransport(
                urls, prefix=prefix, replicas=3, ack_timeout=2.0, publish_timeout=3.0
            )

        await _ready(make)
        transport = make()
        bus = Bus(transport=transport)
        load = LoadThroughAFault(bus)

        victim: list[PrivateServer] = []

        async def kill_the_leader() -> None:
            _, leader = await _stream_replicas(transport, transport.stream)
            assert leader is not None
            victim.append(nodes[int(leader.removeprefix("n")) - 1])
            await victim[0].kill()

        with anyio.fail_after(100):
            async with bus:
                await load.run(kill_the_leader)
                marker_in = await load.handled_again(anyio.current_time())
                await bus.drain(30)
                await victim[0].start()  # the killed node comes back and catches up
                assert await load.after_return() == [1] * 100
        with capsys.disabled():
            print(load.summary("NATS R3, the stream leader killed", marker_in))
        assert len(load.confirmed) + len(load.failed) == load.total
        assert set(load.confirmed) <= load.delivered <= set(load.confirmed) | load.failed
        assert max(load.took) <= 3.0 * 2 + 1.0  # a publish fails in time, never hangs
        assert load.resumed_in() <= 2.0 + 10.0  # ack_timeout + 10 s
        assert marker_in <= 3.0 + 10.0
