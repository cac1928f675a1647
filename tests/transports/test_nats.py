"""NatsTransport against the conformance suite, plus what only JetStream does.

Runs against the local nats-server (JetStream enabled) on asyncio only: nats-py is
asyncio-only. Every test uses its own prefix, so its own streams and consumers, and
deletes them afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.text import TextReceiveStream

from asyncbus import (
    HEADER_REPLAYED,
    Bus,
    ConfigurationError,
    ConnectError,
    DeadLetter,
    DeadLetterReason,
    Envelope,
    Reject,
    TransportError,
)
from asyncbus.testing.transport_suite import TransportSuite
from asyncbus.transports import Delivery, Transport, TransportSettings
from asyncbus.transports._codec import envelope_to_wire
from asyncbus.transports.nats import HEADER_META, NatsTransport, consumer_name

nats = pytest.importorskip("nats")

pytestmark = pytest.mark.timeout(60)

#: ack_timeout of the transports under test: short, so redelivery tests are quick.
ACK_TIMEOUT = 1.0


async def _delete_streams(url: str, prefix: str) -> None:
    """Delete the two streams of ``prefix`` (their consumers go with them)."""
    with anyio.CancelScope(shield=True):
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            js = nc.jetstream()
            probe = NatsTransport(url, prefix=prefix)
            for stream in (probe.stream, probe.dead_letter_stream):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(stream)
        finally:
            await nc.close()


@pytest.fixture
async def cleanup(nats_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """The test's prefix; its streams are deleted after the test."""
    try:
        yield unique_prefix
    finally:
        await _delete_streams(nats_url, unique_prefix)


async def _publish_with_headers(
    url: str, subject: str, body: bytes, headers: dict[str, str]
) -> None:
    nc = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        await nc.jetstream().publish(subject, body, headers=headers)
    finally:
        await nc.close()


class TestNats(TransportSuite):
    """NatsTransport passes the conformance suite."""

    #: Twice the module's: the keep-alive tests hold a delivery past it while a full CI run
    #: loads both cores, and a 1 s ack wait let a late keep-alive through once (RabbitMQ's
    #: suite uses 2 s too).
    ack_timeout = 2 * ACK_TIMEOUT
    #: The server's max_payload is 1 MiB (headers and body together); the suite's
    #: 1 MiB string cannot fit, so the large payload is the largest that does.
    large_payload_size = (1 << 20) - 4096

    @pytest.fixture
    async def transport(self, nats_url: str, cleanup: str) -> AsyncIterator[Transport]:
        async with NatsTransport(
            nats_url, prefix=cleanup, ack_timeout=self.ack_timeout
        ) as transport:
            yield transport

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        assert isinstance(transport, NatsTransport)
        envelope = Envelope(topic=topic)
        meta, _ = envelope_to_wire(envelope, transport.codec)
        await _publish_with_headers(
            transport.url,
            f"{transport.prefix}.{topic}",
            body,
            {"Nats-Msg-Id": envelope.id, HEADER_META: meta.decode()},
        )


# -- transport-specific behaviour ---------------------------------------------------


@pytest.fixture
async def transport(nats_url: str, cleanup: str) -> AsyncIterator[NatsTransport]:
    async with NatsTransport(nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT) as transport:
        yield transport


async def _next(deliveries: AsyncIterator[Any], timeout: float = 10.0) -> Any:
    with anyio.fail_after(timeout):
        return await anext(deliveries)


async def _nothing_within(deliveries: AsyncIterator[Any], seconds: float) -> None:
    with anyio.move_on_after(seconds):
        extra = await anext(deliveries)
        raise AssertionError(f"unexpected delivery {extra.envelope!r}")


@pytest.mark.anyio
async def test_unreachable_server_raises_connect_error_naming_host_and_port() -> None:
    transport = NatsTransport("nats://user:secret@127.0.0.1:4299", connect_timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ConnectError) as caught:
        async with transport:
            pass
    assert "127.0.0.1:4299" in str(caught.value)
    assert "secret" not in str(caught.value)
    assert time.monotonic() - started < 5


def test_topics_prefixes_and_settings_are_validated() -> None:
    with pytest.raises(ConfigurationError):
        NatsTransport(prefix="a b")
    with pytest.raises(ConfigurationError):
        NatsTransport(prefix="bus.>")
    with pytest.raises(ConfigurationError):
        NatsTransport(ack_timeout=0)


@pytest.mark.anyio
async def test_topic_that_is_not_a_nats_subject_is_refused(transport: NatsTransport) -> None:
    for topic in ("has space", "tab\tbed", "a..b", "wild.*"):
        with pytest.raises(ConfigurationError):
            await transport.publish(topic, [Envelope(topic=topic)])


def test_consumer_names_are_deterministic_unique_and_valid() -> None:
    name = consumer_name("orders.*", "tests.mod:Handler.method")
    assert name == consumer_name("orders.*", "tests.mod:Handler.method")
    assert name != consumer_name("orders.>", "tests.mod:Handler.method")
    assert name != consumer_name("orders.*", "tests.mod:Handler_method")
    assert all(ch.isalnum() or ch in "_-" for ch in name), name


@pytest.mark.anyio
async def test_streams_are_created_as_documented(transport: NatsTransport, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        main = (await js.stream_info(transport.stream)).config
        dead = (await js.stream_info(transport.dead_letter_stream)).config
    finally:
        await nc.close()
    assert main.subjects == [f"{transport.prefix}.>"]
    assert main.retention == nats.js.api.RetentionPolicy.INTEREST
    assert main.duplicate_window == pytest.approx(120.0)
    assert dead.subjects == [f"{transport.prefix}_dlq.>"]
    assert dead.max_age == pytest.approx(transport.settings.dead_letter_ttl)
    assert dead.max_msgs == transport.settings.dead_letter_maxlen


@pytest.mark.anyio
async def test_dead_letter_stream_follows_changed_limits(nats_url: str, cleanup: str) -> None:
    async with NatsTransport(nats_url, prefix=cleanup):
        pass
    transport = NatsTransport(nats_url, prefix=cleanup)
    transport.bind(TransportSettings(dead_letter_ttl=3600.0, dead_letter_maxlen=10))
    async with transport:
        nc = await nats.connect(nats_url)
        try:
            dead = (await nc.jetstream().stream_info(transport.dead_letter_stream)).config
        finally:
            await nc.close()
    assert (dead.max_age, dead.max_msgs) == (pytest.approx(3600.0), 10)


async def _dead_letter_stream(url: str, transport: NatsTransport) -> Any:
    nc = await nats.connect(url)
    try:
        return await nc.jetstream().stream_info(transport.dead_letter_stream)
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_the_dead_letter_ttl_can_go_down_and_back_up_on_an_existing_stream(
    nats_url: str, cleanup: str
) -> None:
    """A stream made with a long TTL got a 2-minute duplicate window: a shorter TTL
    (the server refuses an age below the window) and one below JetStream's 100 ms
    shortest age still start the bus, and its dead letters are kept for the new TTL."""
    for ttl in (3600.0, 30.0, 1.0, 0.05, 3600.0):
        transport = NatsTransport(nats_url, prefix=cleanup)
        bus = Bus(transport=transport, dead_letter_ttl=ttl)
        with anyio.fail_after(20):
            async with bus:
                receipt = await bus.publish("nobody.listens", ttl)
                if ttl >= 30:  # (a shorter one may be gone before it is read)
                    stored = [entry.envelope.id for entry in await transport.dead_letters()]
                    assert receipt.id in stored, ttl
                info = await _dead_letter_stream(nats_url, transport)
        assert info.config.max_age == pytest.approx(max(ttl, 0.1)), ttl
        assert info.config.duplicate_window <= info.config.max_age
        if ttl < 30:
            # The server itself drops them once the new TTL passed (every one, also
            # those stored under the long TTL before).
            with anyio.fail_after(10):
                while (await _dead_letter_stream(nats_url, transport)).state.messages:
                    await anyio.sleep(0.1)


@pytest.mark.anyio
async def test_a_max_age_below_the_dedup_window_caps_the_window(
    nats_url: str, cleanup: str
) -> None:
    """JetStream refuses a duplicate window longer than the stream's age."""
    async with NatsTransport(nats_url, prefix=cleanup, max_age=30.0) as transport:
        nc = await nats.connect(nats_url)
        try:
            main = (await nc.jetstream().stream_info(transport.stream)).config
        finally:
            await nc.close()
    assert (main.max_age, main.duplicate_window) == (pytest.approx(30.0), pytest.approx(30.0))


def test_a_max_age_jetstream_cannot_keep_is_refused_at_construction() -> None:
    with pytest.raises(ConfigurationError, match=r"max_age must be at least 0\.1 s"):
        NatsTransport(max_age=0.05)


@pytest.mark.anyio
async def test_a_command_the_server_refuses_costs_a_reconnect_not_the_connection(
    nats_url: str, cleanup: str
) -> None:
    """The server answers a subject over its protocol line with ``-ERR`` and closes the
    connection; nats-py alone would close the client for good (every later publish
    failing with ConnectionClosedError, the pumps dead). The transport reconnects, and
    the bus publishes and consumes as before."""
    transport = NatsTransport(nats_url, prefix=cleanup, reconnect_wait=0.1)
    bus = Bus(transport=transport)
    handled: list[int] = []

    @bus.subscribe("work", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        with anyio.fail_after(30):
            await bus.publish("work", 0)
            await bus.drain()
            nc = transport._connection.nc
            assert nc is not None
            # Past the door (which refuses such a topic): a raw command of the client.
            await nc.publish("x" * 5000, b"")
            while not (nc.stats["reconnects"] >= 1 and nc.is_connected):
                assert not nc.is_closed, "the client closed for good"
                await anyio.sleep(0.05)
            for n in range(1, 11):
                await bus.publish("work", n)
            await bus.drain()
    assert handled == list(range(11))


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["a\tb", "a\x7fb", "a\x00b", "a\u2028b"])
async def test_a_subject_with_whitespace_or_control_characters_is_refused(
    nats_url: str, cleanup: str, name: str
) -> None:
    transport = NatsTransport(nats_url, prefix=cleanup)
    # The transport's checks and the bus's door refuse them (the names' syntax, shared by
    # every transport, catches them before the transport's own limits).
    refused = "cannot carry|whitespace|control character"
    for check in (transport.check_topic, transport.check_pattern):
        with pytest.raises(ConfigurationError, match=refused):
            check(name)
    bus = Bus(transport=transport)
    with pytest.raises(ConfigurationError, match=refused):
        bus.subscribe(name, group="g")
    async with bus:
        with anyio.fail_after(10), pytest.raises(ConfigurationError, match=refused):
            await bus.publish(name, 1)


@pytest.mark.anyio
async def test_nack_delay_is_honoured_by_the_server(nats_url: str, cleanup: str) -> None:
    """nak(delay=) is JetStream's own: not before the delay, and soon after it."""
    # An ack_timeout well past the delay: with one equal to it, a machine busy for a
    # moment let the server's ack wait lapse on the redelivery too (attempt 3).
    async with (
        NatsTransport(nats_url, prefix=cleanup, ack_timeout=3.0) as transport,
        transport.subscribe("later", group="g", prefetch=1) as deliveries,
    ):
        await transport.publish("later", [Envelope(topic="later", payload=1)])
        delivery = await _next(deliveries)
        started = time.monotonic()
        await delivery.nack(delay=1.0)
        again = await _next(deliveries)
        elapsed = time.monotonic() - started
        # Never before the delay; "soon after" allows for a busy machine and for the
        # pull request in flight when the delay ends (they expire within ack_timeout / 2).
        assert 1.0 <= elapsed < 1.0 + 1.5 + 1.5, elapsed
        assert again.envelope.attempt == 2
        await again.ack()


@pytest.mark.anyio
async def test_republished_id_is_dropped_as_a_duplicate(transport: NatsTransport) -> None:
    envelope = Envelope(topic="dedup", payload="once")
    async with transport.subscribe("dedup", group="g", prefetch=5) as deliveries:
        await transport.publish("dedup", [envelope])
        await transport.publish("dedup", [envelope])
        await transport.publish("dedup", [envelope.evolve(payload="twice?")])
        first = await _next(deliveries)
        assert (first.envelope.id, first.envelope.payload) == (envelope.id, "once")
        await first.ack()
        await _nothing_within(deliveries, 0.5)
        assert await transport.backlog("dedup", "g") == 0


@pytest.mark.anyio
async def test_replay_of_an_id_is_not_dropped_as_a_duplicate(transport: NatsTransport) -> None:
    """A replayed envelope keeps its id but is published anew, within the window too."""
    envelope = Envelope(topic="again", payload=1)
    replayed = envelope.evolve(headers={HEADER_REPLAYED: "1"}, timestamp=time.time() + 1)
    async with transport.subscribe("again", group="g", prefetch=5) as deliveries:
        await transport.publish("again", [envelope])
        await (await _next(deliveries)).ack()
        await transport.publish("again", [replayed])
        second = await _next(deliveries)
        assert second.envelope.id == envelope.id
        assert second.envelope.headers[HEADER_REPLAYED] == "1"
        assert second.envelope.attempt == 1
        await second.ack()
        await transport.publish_to_group("again", "g", [replayed])
        third = await _next(deliveries)
        assert third.envelope.id == envelope.id
        await third.ack()


@pytest.mark.anyio
async def test_publish_to_group_refuses_a_topic_outside_the_pattern(
    transport: NatsTransport,
) -> None:
    with pytest.raises(ConfigurationError):
        await transport.publish_to_group("a.*", "g", [Envelope(topic="b.c")])


@pytest.mark.anyio
async def test_non_ascii_fields_travel_as_ascii_headers(
    transport: NatsTransport, nats_url: str
) -> None:
    """Header values stay ASCII (older nats-py drops a header block that is not)."""
    seen: list[str] = []
    tapped = anyio.Event()

    async def tap(msg: Any) -> None:
        seen.append(msg.headers[HEADER_META])
        tapped.set()

    nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
    try:
        await nc.subscribe(f"{transport.prefix}.accents", cb=tap)
        await nc.flush()
        async with transport.subscribe("accents", group="g", prefetch=1) as deliveries:
            sent = Envelope(topic="accents", payload="café", headers={"user": "José 🚀"})
            await transport.publish("accents", [sent])
            delivery = await _next(deliveries)
            assert delivery.error is None
            assert (delivery.envelope.headers, delivery.envelope.payload) == (
                {"user": "José 🚀"},
                "café",
            )
            await delivery.ack()
        with anyio.fail_after(5):
            await tapped.wait()
    finally:
        await nc.close()
    [header] = seen
    assert header.isascii()
    assert json.loads(header)["headers"] == {"user": "José 🚀"}


@pytest.mark.anyio
async def test_oversized_envelope_is_refused_at_publish(transport: NatsTransport) -> None:
    huge = Envelope(topic="big", payload="x" * (1 << 20))
    with pytest.raises(TransportError, match="max_payload"):
        await transport.publish("big", [huge])
    # The connection survives (the server never saw the oversized message).
    async with transport.subscribe("big", group="g", prefetch=1) as deliveries:
        await transport.publish("big", [Envelope(topic="big", payload="small")])
        await (await _next(deliveries)).ack()


@pytest.mark.anyio
async def test_a_plain_message_whose_body_does_not_decode_is_delivered_with_an_error(
    transport: NatsTransport, nats_url: str
) -> None:
    async with transport.subscribe("foreign.*", group="g", prefetch=1) as deliveries:
        await _publish_with_headers(
            nats_url, f"{transport.prefix}.foreign.x", b"plain bytes", {"Nats-Msg-Id": "f-1"}
        )
        delivery = await _next(deliveries)
        assert delivery.error and "body is not valid JSON" in delivery.error
        assert (delivery.envelope.id, delivery.envelope.topic) == ("f-1", "foreign.x")
        assert delivery.envelope.payload == b"plain bytes"
        await delivery.reject(DeadLetterReason.REJECTED.value, error=delivery.error)
    [entry] = await transport.dead_letters()
    assert entry.envelope.payload == b"plain bytes"


@pytest.mark.anyio
async def test_dead_letters_survive_a_new_transport_instance(
    transport: NatsTransport, nats_url: str, cleanup: str
) -> None:
    sent = Envelope(topic="poison", payload={"bad": True}, headers={"h": "v"})
    async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
        await transport.publish("poison", [sent])
        delivery = await _next(deliveries)
        await delivery.reject(DeadLetterReason.HANDLER_FAILED.value, error="E: x", stage="s")
    await transport.add_dead_letter(
        DeadLetter(
            Envelope(topic="t", payload=b"\x00raw"),
            DeadLetterReason.DROPPED,
            None,
            None,
            0,
            time.time(),
        )
    )
    await transport.aclose()
    async with NatsTransport(nats_url, prefix=cleanup) as fresh:
        entries = await fresh.dead_letters()
        assert entries[0].envelope.id == sent.id
        assert (entries[0].reason, entries[0].error, entries[0].stage, entries[0].attempts) == (
            DeadLetterReason.HANDLER_FAILED,
            "E: x",
            "s",
            1,
        )
        assert entries[0].envelope.payload == {"bad": True}
        assert entries[1].envelope.payload == b"\x00raw"
        await fresh.remove_dead_letters([sent.id])
        assert [e.reason for e in await fresh.dead_letters()] == [DeadLetterReason.DROPPED]


@pytest.mark.anyio
async def test_dead_letter_with_an_odd_envelope_id_is_stored_and_removed(
    transport: NatsTransport,
) -> None:
    odd = Envelope(id="order 17/ü.*>", topic="t", payload=1)
    await transport.add_dead_letter(
        DeadLetter(odd, DeadLetterReason.EXPIRED, None, None, 1, time.time())
    )
    assert [e.envelope.id for e in await transport.dead_letters()] == [odd.id]
    await transport.remove_dead_letters([odd.id])
    assert await transport.dead_letters() == []


@pytest.mark.anyio
async def test_many_dead_letters_are_read_in_order(transport: NatsTransport) -> None:
    now = time.time()
    added = [
        DeadLetter(Envelope(topic="t", payload=n), DeadLetterReason.DROPPED, None, None, 1, now)
        for n in range(600)
    ]
    for entry in added:
        await transport.add_dead_letter(entry)
    listed = await transport.dead_letters()
    assert [e.envelope.payload for e in listed] == list(range(600))


@pytest.mark.anyio
async def test_keep_alive_holds_deliveries_past_ack_timeout(nats_url: str, cleanup: str) -> None:
    """With keep_alive, a live consumer keeps what it holds past ack_timeout."""
    async with (
        NatsTransport(nats_url, prefix=cleanup, ack_timeout=0.6, keep_alive=True) as transport,
        transport.subscribe("slow", group="g", prefetch=1) as holder,
    ):
        await transport.publish("slow", [Envelope(topic="slow", payload=1)])
        held = await _next(holder)
        async with transport.subscribe("slow", group="g", prefetch=1) as other:
            await _nothing_within(other, 2.0)
        await held.ack()


async def _lines(stream: Any) -> AsyncIterator[dict[str, Any]]:
    buffer = ""
    async for text in TextReceiveStream(stream):
        buffer += text
        while "\n" in buffer:
            line, buffer = buffer.split("\n", 1)
            yield json.loads(line)


_CONSUMER_SCRIPT = """
import asyncio, json, sys
from asyncbus.transports.nats import NatsTransport

async def main(url, prefix, count, ack_timeout):
    # keep_alive: while alive it holds its deliveries however long; only death frees them.
    async with NatsTransport(url, prefix=prefix, ack_timeout=ack_timeout, keep_alive=True) as t:
        async with t.subscribe("crash.*", group="workers", prefetch=count) as deliveries:
            print(json.dumps({"ready": True}), flush=True)
            taken = []
            async for delivery in deliveries:
                taken.append(delivery.envelope.id)
                if len(taken) == count:
                    print(json.dumps({"taken": taken}), flush=True)
                    await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
"""


@pytest.mark.anyio
async def test_deliveries_of_a_killed_process_reach_a_survivor_within_ack_timeout(
    transport: NatsTransport, nats_url: str, cleanup: str
) -> None:
    count = 5
    sent = [Envelope(topic="crash.job", payload=n) for n in range(count)]
    process = await anyio.open_process(
        [sys.executable, "-c", _CONSUMER_SCRIPT, nats_url, cleanup, str(count), str(ACK_TIMEOUT)],
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        lines = _lines(process.stdout)
        with anyio.fail_after(15):
            assert (await anext(lines)) == {"ready": True}
            await transport.publish("crash.job", sent)
            taken = (await anext(lines))["taken"]
        assert sorted(taken) == sorted(e.id for e in sent)
        async with transport.subscribe("crash.*", group="workers", prefetch=count) as survivor:
            # The child holds them (keep-alive) while it lives.
            await _nothing_within(survivor, ACK_TIMEOUT + 0.5)
            os.kill(process.pid, signal.SIGKILL)
            killed = time.monotonic()
            got: list[Envelope] = []
            with anyio.fail_after(ACK_TIMEOUT + 1.0):
                while len(got) < count:
                    delivery = await anext(survivor)
                    got.append(delivery.envelope)
                    await delivery.ack()
            elapsed = time.monotonic() - killed
        assert sorted(e.id for e in got) == sorted(taken)
        assert all(e.attempt == 2 for e in got), [e.attempt for e in got]
        assert elapsed <= ACK_TIMEOUT + 1.0
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.CancelScope(shield=True):
            await process.wait()
            await process.aclose()


@pytest.mark.anyio
async def test_two_connections_in_one_group_split_the_work(
    transport: NatsTransport, nats_url: str, cleanup: str
) -> None:
    sent = [Envelope(topic="split", payload=n) for n in range(500)]
    seen: dict[str, list[str]] = {"a": [], "b": []}
    async with NatsTransport(nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT) as other:

        async def consume(name: str, deliveries: AsyncIterator[Delivery]) -> None:
            async for delivery in deliveries:
                seen[name].append(delivery.envelope.id)
                await delivery.ack()

        async with (
            transport.subscribe("split", group="g", prefetch=16) as first,
            other.subscribe("split", group="g", prefetch=16) as second,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(consume, "a", first)
            tg.start_soon(consume, "b", second)
            await transport.publish("split", sent)
            with anyio.fail_after(15):
                while len(seen["a"]) + len(seen["b"]) < len(sent):
                    await anyio.sleep(0.02)
            await anyio.sleep(0.3)
            tg.cancel_scope.cancel()
    assert sorted(seen["a"] + seen["b"]) == sorted(e.id for e in sent)
    assert seen["a"] and seen["b"]


# -- the bus over NATS --------------------------------------------------------------


async def _wait_for_consumer(transport: NatsTransport, pattern: str, group: str) -> None:
    """Until the bus's pump has created the group's consumer (see the module notes)."""
    nc = await nats.connect(transport.url)
    try:
        js = nc.jetstream()
        with anyio.fail_after(10):
            while True:
                try:
                    await js.consumer_info(transport.stream, consumer_name(pattern, group))
                    return
                except nats.js.errors.NotFoundError:
                    await anyio.sleep(0.01)
    finally:
        await nc.close()


@pytest.mark.anyio
async def test_bus_over_nats_handles_dead_letters_and_replays(nats_url: str, cleanup: str) -> None:
    transport = NatsTransport(nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT)
    handled: list[Any] = []
    healed = False
    bus = Bus(transport=transport)

    @bus.subscribe("jobs.*", group="workers")
    async def work(n: int) -> None:
        if n == 3 and not healed:
            raise Reject("three is bad")
        handled.append(n)

    with anyio.fail_after(30):
        async with bus:
            await _wait_for_consumer(transport, "jobs.*", "workers")
            for n in range(5):
                await bus.publish("jobs.run", n)
            await bus.drain()
            assert sorted(handled) == [0, 1, 2, 4]
            [dead] = bus.dead_letters.list()
            assert (dead.reason, dead.stage) == (DeadLetterReason.REJECTED, "jobs.*@workers")
        second = Bus(transport=transport)
        second.subscribe("jobs.*", work, group="workers")
        async with second:
            [restored] = second.dead_letters.list()
            assert restored.envelope.id == dead.envelope.id
            healed = True
            await second.dead_letters.replay(restored.envelope.id)
            await second.drain()
            assert sorted(handled) == [0, 1, 2, 3, 4]
            assert await transport.dead_letters() == []


# -- a server restarted under load ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _start_server(port: int, store: str) -> anyio.abc.Process:
    """A private nats-server with JetStream on loopback, ready to accept connections."""
    process = await anyio.open_process(
        [NATS_SERVER, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with anyio.fail_after(10):
        while True:
            try:
                stream = await anyio.connect_tcp("127.0.0.1", port)
            except OSError:
                await anyio.sleep(0.05)
            else:
                await stream.aclose()
                return process


async def _stop_server(process: anyio.abc.Process) -> None:
    with anyio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
        await process.wait()
        await process.aclose()


NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


@pytest.mark.anyio
@pytest.mark.skipif(not os.path.exists(NATS_SERVER), reason="no nats-server binary")
async def test_server_restart_under_load_loses_no_confirmed_publish(tmp_path: Any) -> None:
    """The client reconnects by itself; the subscription resumes without a restart."""
    port = _free_port()
    store = str(tmp_path / "js")
    server = await _start_server(port, store)
    url = f"nats://127.0.0.1:{port}"
    confirmed: list[str] = []
    received: set[str] = set()
    try:
        async with (
            NatsTransport(url, ack_timeout=ACK_TIMEOUT, request_timeout=1.0) as transport,
            transport.subscribe("load", group="g", prefetch=50) as deliveries,
            anyio.create_task_group() as tg,
        ):

            async def consume() -> None:
                while True:
                    try:
                        delivery = await anext(deliveries)
                    except TransportError:
                        await anyio.sleep(0.05)
                        continue
                    received.add(delivery.envelope.id)
                    with contextlib.suppress(TransportError):
                        await delivery.ack()

            async def produce(stop: anyio.Event, stopped: anyio.Event) -> None:
                while not stop.is_set():
                    envelope = Envelope(topic="load", payload=len(confirmed))
                    try:
                        await transport.publish("load", [envelope])
                    except TransportError:
                        await anyio.sleep(0.05)  # down: not confirmed, so not counted
                        continue
                    confirmed.append(envelope.id)
                    await anyio.sleep(0.002)
                stopped.set()

            stop, stopped = anyio.Event(), anyio.Event()
            tg.start_soon(consume)
            tg.start_soon(produce, stop, stopped)
            with anyio.fail_after(10):
                while len(confirmed) < 100:
                    await anyio.sleep(0.01)
            await _stop_server(server)
            await anyio.sleep(0.5)
            server = await _start_server(port, store)
            before = len(confirmed)
            with anyio.fail_after(15):
                while len(confirmed) < before + 100:
                    await anyio.sleep(0.01)
            stop.set()
            await stopped.wait()
            with anyio.fail_after(ACK_TIMEOUT + 10):
                while not received.issuperset(confirmed):
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
    finally:
        await _stop_server(server)
    assert received.issuperset(confirmed)


@pytest.mark.anyio
async def test_cancelled_wait_for_a_delivery_keeps_the_subscription_usable(
    transport: NatsTransport,
) -> None:
    async with transport.subscribe("patient", group="g", prefetch=2) as deliveries:
        with anyio.move_on_after(0.2):
            await anext(deliveries)
        await transport.publish("patient", [Envelope(topic="patient", payload=1)])
        delivery = await _next(deliveries)
        assert delivery.envelope.payload == 1
        await delivery.ack()


async def _delete_consumer(url: str, stream: str, name: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_consumer(stream, name)
    finally:
        await nc.close()


async def _consumer_made_again(transport: NatsTransport, name: str, timeout: float) -> None:
    with anyio.fail_after(timeout):
        while not await transport._consumer_exists(name):
            await anyio.sleep(0.05)


@pytest.mark.anyio
async def test_deleted_consumer_is_made_again_and_consuming_goes_on(
    transport: NatsTransport, nats_url: str
) -> None:
    """Deleted while a pull request waits (the server ends it: 409 Consumer Deleted)."""
    name = consumer_name("doomed", "g")
    async with transport.subscribe("doomed", group="g", prefetch=1) as deliveries:
        async with anyio.create_task_group() as tg:
            got: list[Delivery] = []

            async def take() -> None:
                got.append(await anext(deliveries))

            tg.start_soon(take)
            await anyio.sleep(0.2)  # the pull request is open
            await _delete_consumer(nats_url, transport.stream, name)
            await _consumer_made_again(transport, name, 10)
            await transport.publish("doomed", [Envelope(topic="doomed", payload=1)])
        [delivery] = got
        assert delivery.envelope.payload == 1
        await delivery.ack()


@pytest.mark.anyio
async def test_backlog_counts_delayed_nacks_until_redelivered_and_acked(
    transport: NatsTransport,
) -> None:
    async with transport.subscribe("wait", group="g", prefetch=1) as deliveries:
        await transport.publish("wait", [Envelope(topic="wait", payload=1)])
        delivery = await _next(deliveries)
        await delivery.nack(delay=0.5)
        assert await transport.backlog("wait", "g") == 1
        again = await _next(deliveries)
        await again.ack()
        with anyio.fail_after(5):
            while await transport.backlog("wait", "g"):
                await anyio.sleep(0.02)


@pytest.mark.anyio
async def test_consumer_deleted_while_no_request_waits_is_made_again(
    transport: NatsTransport, nats_url: str
) -> None:
    """A pull on a deleted consumer gets no reply at all; the expired request tells."""
    name = consumer_name("doomed", "g")
    async with transport.subscribe("doomed", group="g", prefetch=1) as deliveries:
        await transport.publish("doomed", [Envelope(topic="doomed", payload=1)])
        delivery = await _next(deliveries)  # the request is fulfilled: none waits now
        await _delete_consumer(nats_url, transport.stream, name)
        await delivery.ack()
        async with anyio.create_task_group() as tg:
            got: list[Delivery] = []

            async def take() -> None:
                got.append(await _next(deliveries, 20))

            tg.start_soon(take)
            await _consumer_made_again(transport, name, 15)
            await transport.publish("doomed", [Envelope(topic="doomed", payload=2)])
        assert [d.envelope.payload for d in got] == [2]
        await got[0].ack()


@pytest.mark.anyio
async def test_dead_letter_stream_expires_entries_after_the_ttl(
    nats_url: str, cleanup: str
) -> None:
    transport = NatsTransport(nats_url, prefix=cleanup)
    transport.bind(TransportSettings(dead_letter_ttl=1.0))  # as the bus does before entering
    async with transport:
        entry = DeadLetter(
            Envelope(topic="t", payload=1), DeadLetterReason.DROPPED, None, None, 0, time.time()
        )
        await transport.add_dead_letter(entry)
        assert len(await transport.dead_letters()) == 1
        await anyio.sleep(1.5)
        # Only the server's max_age can drop it now.
        transport.bind(TransportSettings(dead_letter_ttl=3600.0))
        assert await transport.dead_letters() == []


@pytest.mark.anyio
async def test_large_batch_is_pipelined_in_publish_order(transport: NatsTransport) -> None:
    sent = [Envelope(topic="bulk", payload=n) for n in range(1000)]
    got: list[int] = []
    async with transport.subscribe("bulk", group="g", prefetch=100) as deliveries:
        await transport.publish("bulk", sent)
        with anyio.fail_after(15):
            while len(got) < len(sent):
                delivery = await anext(deliveries)
                got.append(delivery.envelope.payload)
                await delivery.ack()
    assert got == list(range(1000))


@pytest.mark.anyio
async def test_many_envelopes_are_one_write_and_all_stored_when_publish_returns(
    transport: NatsTransport,
) -> None:
    """200 envelopes of one publish() leave in one socket write (one round trip), and
    the call returns once the stream stored every one; each is delivered once, in order."""
    sent = [Envelope(topic="bulk", payload=n) for n in range(200)]
    connection: Any = transport._connection.nc._transport  # type: ignore[union-attr]  # nats-py's socket
    command = f"HPUB {transport.prefix}.bulk ".encode()
    writes: list[int] = []
    write_lines = connection.writelines

    def counting(chunks: list[bytes]) -> Any:
        published = b"".join(chunks).count(command)
        if published:
            writes.append(published)
        return write_lines(chunks)

    got: list[int] = []
    async with transport.subscribe("bulk", group="g", prefetch=256) as deliveries:
        connection.writelines = counting
        try:
            await transport.publish("bulk", sent)
        finally:
            del connection.writelines  # the class's method again
        assert writes == [200]
        assert await transport.backlog("bulk", "g") == 200  # all stored on return
        with anyio.fail_after(15):
            while len(got) < len(sent):
                delivery = await anext(deliveries)
                assert delivery.envelope.id == sent[len(got)].id
                got.append(delivery.envelope.payload)
                await delivery.ack()
        await _nothing_within(deliveries, 0.3)
    assert got == list(range(200))


@pytest.mark.anyio
async def test_a_message_sent_again_while_held_or_once_acked_is_handled_once(
    transport: NatsTransport, nats_url: str
) -> None:
    """A 2.9 server was seen to send a message twice, the second time as if new (its
    delivery count 1), while the first was still held or its ack on its way: the copy
    is not handed out again, and once acked it is acked again, not left pending.

    (The server refuses a client's publish with a ``$JS.ACK`` reply, so the copy is
    handed to the subscription's inbox callback as nats-py would.)"""
    from nats.aio.msg import Msg

    async with transport.subscribe("copies", group="g", prefetch=4) as deliveries:
        await transport.publish("copies", [Envelope(topic="copies", payload=1)])
        held = await _next(deliveries)
        msg = held._msg
        tokens = msg.reply.split(".")
        tokens[4] = "1"  # as if new
        copy_reply = ".".join(tokens)
        nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
        try:

            async def send_copy() -> None:
                copy = Msg(
                    _client=msg._client,
                    subject=msg.subject,
                    reply=copy_reply,
                    data=msg.data,
                    headers=dict(msg.headers or {}),
                )
                await deliveries.on_message(copy)

            await send_copy()
            await _nothing_within(deliveries, 0.5)
            await held.ack()
            await send_copy()
            await _nothing_within(deliveries, 0.5)
            await deliveries.flush()
            info = await nc.jetstream().consumer_info(
                transport.stream, consumer_name("copies", "g")
            )
            assert (info.num_ack_pending, info.num_redelivered) == (0, 0)
        finally:
            await nc.close()
        await _nothing_within(deliveries, ACK_TIMEOUT + 0.5)


@pytest.mark.anyio
async def test_acks_written_behind_are_written_before_the_subscription_ends(
    transport: NatsTransport,
) -> None:
    sent = [Envelope(topic="acks", payload=n) for n in range(20)]
    async with transport.subscribe("acks", group="g", prefetch=32) as deliveries:
        await transport.publish("acks", sent)
        for _ in sent:
            delivery = await _next(deliveries)
            assert delivery.acks_behind
            delivery.ack_nowait()  # queued for the writer; the subscription ends at once
        name = consumer_name("acks", "g")
        assert transport._acks.queued(name)
    assert not transport._acks.queued(name)  # written as the subscription ended
    assert transport.unsettled_acks() == []
    # Not given back, not redelivered after ack_timeout: the server has the acks.
    async with transport.subscribe("acks", group="g", prefetch=32) as deliveries:
        await _nothing_within(deliveries, ACK_TIMEOUT + 0.5)


@pytest.mark.anyio
async def test_acks_queued_when_the_connection_is_gone_are_reported_lost(
    nats_url: str, cleanup: str
) -> None:
    sent = Envelope(topic="lost", payload=1)
    transport = NatsTransport(nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT)
    async with transport, transport.subscribe("lost", group="g", prefetch=1) as deliveries:
        await transport.publish("lost", [sent])
        delivery = await _next(deliveries)
        assert transport._connection.nc is not None
        await transport._connection.nc.close()  # the connection goes before the writer writes
        delivery.ack_nowait()
    assert transport.unsettled_acks() == [("lost@g", sent.id)]
    assert transport.unsettled_acks() == []  # reported once


@pytest.mark.anyio
async def test_a_group_announced_while_a_routed_publish_travels_is_named_in_its_receipt(
    transport: NatsTransport, nats_url: str, cleanup: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another process makes group "late" for the topic after this transport looked up the
    # groups of a publish and before the publish is stored: the server announces the new
    # consumer before it acknowledges the publish, and the receipt names every group the
    # message went to, "late" too.
    announced = anyio.Event()
    forget = transport._groups.forget

    def forget_and_tell() -> None:
        forget()
        announced.set()

    monkeypatch.setattr(transport._groups, "forget", forget_and_tell)
    publish = transport.publish
    with anyio.fail_after(30):
        async with contextlib.AsyncExitStack() as stack:
            other = await stack.enter_async_context(
                NatsTransport(nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT)
            )
            audit = await stack.enter_async_context(
                other.subscribe("orders.*", group="audit", prefetch=10)
            )
            first = Envelope(topic="orders.shipped")
            assert await transport.publish_routed("orders.shipped", [first]) == ("orders.*@audit",)
            await (await _next(audit)).ack()

            async def publish_as_a_group_appears(topic: str, envelopes: Any) -> None:
                late = other.subscribe("orders.shipped", group="late", prefetch=10)
                stack.push_async_exit(late.__aexit__)
                deliveries.append(await late.__aenter__())
                await announced.wait()
                await publish(topic, envelopes)

            deliveries: list[AsyncIterator[Any]] = []
            monkeypatch.setattr(transport, "publish", publish_as_a_group_appears)
            second = Envelope(topic="orders.shipped")
            reached = await transport.publish_routed("orders.shipped", [second])
            assert reached == ("orders.*@audit", "orders.shipped@late")
            for got in (await _next(audit), await _next(deliveries[0])):
                assert got.envelope.id == second.id
                await got.ack()


@pytest.mark.anyio
@pytest.mark.parametrize("routed", [False, True], ids=["publish", "publish_routed"])
async def test_a_publish_while_a_restore_hangs_raises_transport_error_at_publish_timeout(
    nats_url: str, cleanup: str, monkeypatch: pytest.MonkeyPatch, routed: bool
) -> None:
    # Another task makes the streams and consumers again and the server stops answering
    # it: a publish, routed or not, waits for it no longer than publish_timeout.
    publish_timeout = 0.5
    transport = NatsTransport(
        nats_url, prefix=cleanup, ack_timeout=ACK_TIMEOUT, publish_timeout=publish_timeout
    )
    restoring = anyio.Event()
    answer = anyio.Event()
    ensure_streams = transport._setup.ensure_streams

    async def hanging_ensure_streams(js: Any) -> None:
        restoring.set()
        await answer.wait()
        await ensure_streams(js)

    async def publish(envelope: Envelope) -> tuple[str, ...] | None:
        if routed:
            return await transport.publish_routed("held", [envelope])
        await transport.publish("held", [envelope])
        return None

    with anyio.fail_after(30):
        async with transport, transport.subscribe("held", group="g", prefetch=4) as deliveries:
            monkeypatch.setattr(transport._setup, "ensure_streams", hanging_ensure_streams)
            async with anyio.create_task_group() as tg:
                tg.start_soon(transport._restore)
                await restoring.wait()
                started = time.monotonic()
                with pytest.raises(TransportError, match="being made again") as caught:
                    await publish(Envelope(topic="held", payload=1))
                waited = time.monotonic() - started
                assert publish_timeout <= waited < publish_timeout + 0.5
                assert f"not done within {publish_timeout:g} s" in str(caught.value)
                answer.set()
            # The restore done, a publish goes through as before.
            sent = Envelope(topic="held", payload=2)
            assert await publish(sent) == (("held@g",) if routed else None)
            got = await _next(deliveries)
            assert got.envelope.id == sent.id
            await got.ack()


def _no_responders_to_the_next_pull(
    transport: NatsTransport, deliveries: Any, monkeypatch: pytest.MonkeyPatch
) -> list[bool]:
    """Send the subscription's next pull to a subject nobody listens on, so the server
    answers it ``503`` (no responders), as a cluster does while it elects the consumer's
    leader; once the subscription asks whether its consumer exists, its pulls go where
    they belong again. Returns the answers it gets to that question."""
    answers: list[bool] = []
    next_subject = deliveries.next_subject
    deliveries.next_subject = f"asyncbus-test.nobody.{deliveries.inbox}"
    consumer_exists = transport._consumer_exists

    async def elected(name: str) -> bool:
        deliveries.next_subject = next_subject
        exists = await consumer_exists(name)
        answers.append(exists)
        return exists

    monkeypatch.setattr(transport, "_consumer_exists", elected)
    return answers


@pytest.mark.anyio
async def test_a_pull_answered_no_responders_while_the_consumer_exists_is_asked_again(
    transport: NatsTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server says the consumer exists: it is pulled from again, not made again.
    with anyio.fail_after(20):
        async with transport.subscribe("elect", group="g", prefetch=4) as deliveries:
            answers = _no_responders_to_the_next_pull(transport, deliveries, monkeypatch)
            sent = Envelope(topic="elect", payload=1)
            await transport.publish("elect", [sent])
            got = await _next(deliveries)
            assert got.envelope.id == sent.id
            await got.ack()
            assert (answers, transport._restorer.restores, deliveries.failure) == ([True], 0, None)


@pytest.mark.anyio
async def test_a_pull_answered_no_responders_once_the_consumer_is_gone_makes_it_again(
    transport: NatsTransport, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same answer once the consumer is gone (deleted while no pull was open): the
    # server says so, and the consumer is made again before the next pull.
    restored = anyio.Event()
    restore = transport._restore

    async def restore_and_tell(consumer: Any = None) -> None:
        await restore(consumer)
        restored.set()

    monkeypatch.setattr(transport, "_restore", restore_and_tell)
    name = consumer_name("lost", "g")
    with anyio.fail_after(20):
        async with transport.subscribe("lost", group="g", prefetch=4) as deliveries:
            answers = _no_responders_to_the_next_pull(transport, deliveries, monkeypatch)
            nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
            try:
                assert await nc.jetstream().delete_consumer(transport.stream, name)
            finally:
                await nc.close()
            got: list[Any] = []

            async def take() -> None:
                got.append(await anext(deliveries))

            sent = Envelope(topic="lost", payload=1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(take)
                await restored.wait()
                assert answers == [False]
                await transport.publish("lost", [sent])
            assert [delivery.envelope.id for delivery in got] == [sent.id]
            await got[0].ack()
            assert (answers, transport._restorer.restores, deliveries.failure) == ([False], 1, None)
