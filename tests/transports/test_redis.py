"""RedisTransport against a real Redis (127.0.0.1:6379): the conformance suite and its own.

Every test runs on asyncio, plain and with uvloop, never on trio: redis-py's client is
asyncio-only. Each test uses its own key prefix and deletes every ``{prefix}:*`` key
afterwards. The crash tests kill real consumer processes (``_redis_worker.py``) with
SIGKILL; one test starts a Redis server of its own (loopback, a free port) and restarts it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _brokers import forget, publish_verbatim  # type: ignore[import-not-found]
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncbus import (
    Bus,
    ConfigurationError,
    ConnectError,
    DeadLetter,
    DeadLetterReason,
    Envelope,
    Reject,
    Retry,
    TransportError,
)
from asyncbus.testing.transport_suite import QUIET, TransportSuite
from asyncbus.transports import Transport
from asyncbus.transports.base import Delivery
from asyncbus.transports.redis import RedisTransport

# redis-py runs on asyncio only: plain and with uvloop, no trio.
pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio", "uvloop")]

ACK_TIMEOUT = 1.0
WORKER = Path(__file__).with_name("_redis_worker.py")


@pytest.fixture
async def clean_prefix(redis_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``, whose keys are deleted after the test."""
    yield unique_prefix
    with anyio.CancelScope(shield=True):
        await forget("redis", redis_url, unique_prefix)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Any]:
    """A raw redis-py client, to look at (and tamper with) the keys."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


class TestRedis(TransportSuite):
    """RedisTransport passes the conformance suite."""

    ack_timeout = ACK_TIMEOUT

    @pytest.fixture
    async def transport(self, redis_url: str, clean_prefix: str) -> AsyncIterator[Transport]:
        """An entered RedisTransport with a prefix unique to the test."""
        async with RedisTransport(
            redis_url, prefix=clean_prefix, ack_timeout=self.ack_timeout
        ) as transport:
            yield transport

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        """Publish through the transport with a codec that writes ``body`` verbatim."""
        await publish_verbatim(transport, topic, body)


# -- helpers ------------------------------------------------------------------------


async def _next(deliveries: AsyncIterator[Delivery], timeout: float = 10.0) -> Delivery:
    with anyio.fail_after(timeout):
        return await anext(deliveries)


async def _nothing_within(deliveries: AsyncIterator[Delivery], seconds: float = QUIET) -> None:
    with anyio.move_on_after(seconds):
        extra = await anext(deliveries)
        pytest.fail(f"unexpected delivery {extra.envelope!r}")


def _stream_key(transport: Transport, pattern: str, group: str) -> str:
    assert isinstance(transport, RedisTransport)
    return transport.stream_key(pattern, group)


async def _backlog_becomes_zero(transport: Transport, pattern: str, group: str) -> None:
    # Acks are written behind (within milliseconds): poll under a deadline.
    with anyio.fail_after(5):
        while await transport.backlog(pattern, group):
            await anyio.sleep(0.02)


def _envelopes(topic: str, count: int) -> list[Envelope]:
    return [Envelope(topic=topic, payload={"n": n}) for n in range(count)]


class _Worker:
    """A consumer in another process (``_redis_worker.py``), read line by line."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._lines = BufferedByteReceiveStream(process.stdout)

    async def line(self, timeout: float = 10.0) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            data = await self._lines.receive_until(b"\n", 1 << 16)
        result: dict[str, Any] = json.loads(data)
        return result

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)


async def _start_worker(
    url: str, prefix: str, pattern: str, group: str, prefetch: int, mode: str
) -> _Worker:
    process = await anyio.open_process(
        [
            sys.executable,
            str(WORKER),
            url,
            prefix,
            pattern,
            group,
            str(prefetch),
            str(ACK_TIMEOUT),
            mode,
        ],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    worker = _Worker(process)
    assert await worker.line(30.0) == {"ready": True}
    return worker


@pytest.fixture
async def workers() -> AsyncIterator[list[_Worker]]:
    """Worker processes started by the test; killed and reaped afterwards."""
    started: list[_Worker] = []
    yield started
    with anyio.CancelScope(shield=True), anyio.fail_after(10):
        for worker in started:
            if worker.process.returncode is None:
                worker.kill()
            await worker.process.wait()
            await worker.process.aclose()


# -- connecting -----------------------------------------------------------------------


async def test_unreachable_server_raises_connect_error_naming_it_without_password() -> None:
    transport = RedisTransport("redis://user:s3cret@127.0.0.1:1/0")
    with pytest.raises(ConnectError) as caught:
        async with transport:
            pass
    message = str(caught.value)
    assert "127.0.0.1:1" in message
    assert "s3cret" not in message


async def test_missing_redis_extra_raises_connect_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)
    monkeypatch.setitem(sys.modules, "redis.asyncio", None)
    with pytest.raises(ConnectError, match=r"asyncbus\[redis\]"):
        async with RedisTransport():
            pass


def test_importing_the_transport_does_not_import_redis() -> None:
    code = (
        "import sys, asyncbus\n"
        "from asyncbus.transports import RedisTransport\n"
        "RedisTransport(prefix='x')\n"
        "assert 'redis' not in sys.modules, 'redis was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_using_the_transport_before_entering_it_raises(clean_prefix: str) -> None:
    transport = RedisTransport(prefix=clean_prefix)
    with pytest.raises(TransportError, match="not connected"):
        await transport.publish("a", [Envelope(topic="a")])
    with pytest.raises(TransportError, match="not connected"):
        await transport.publish_to_group("a", "g", [Envelope(topic="a")])
    with pytest.raises(TransportError, match="not connected"):
        async with transport.subscribe("a", group="g", prefetch=1):
            pass
    with pytest.raises(TransportError, match="not connected"):
        await transport.remove_dead_letters(["x"])
    with pytest.raises(TransportError, match="not connected"):
        await transport.dead_letters()


# -- routing --------------------------------------------------------------------------


async def test_binding_made_by_another_process_receives_the_next_publish(
    redis_url: str, clean_prefix: str
) -> None:
    """The publisher's cached bindings are refreshed when a binding appears elsewhere."""
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as publisher,
        RedisTransport(redis_url, prefix=clean_prefix) as other,
    ):
        await publisher.publish("late.topic", [Envelope(topic="late.topic", payload=0)])
        async with other.subscribe("late.*", group="g", prefetch=5) as deliveries:
            sent = Envelope(topic="late.topic", payload=1)
            await publisher.publish("late.topic", [sent])
            delivery = await _next(deliveries)
            assert delivery.envelope.id == sent.id
            await delivery.ack()
            await _nothing_within(deliveries)


async def test_concurrent_publishes_share_one_write_and_each_arrives_once(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    """A burst of publishes from many tasks is one script call, delivered to every group."""
    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        for group in ("a", "b"):
            await transport._bindings.bind("burst.*", group)
        batches: list[int] = []
        write = transport._publisher.write

        async def counting_write(batch: list[Any]) -> None:
            batches.append(len(batch))
            await write(batch)

        transport._publisher.writes._write = counting_write
        sent = _envelopes("burst.x", 300)
        async with anyio.create_task_group() as task_group:
            for envelope in sent:
                task_group.start_soon(transport.publish, "burst.x", [envelope])
        assert batches == [300]
        for group in ("a", "b"):
            entries = await redis.xrange(_stream_key(transport, "burst.*", group))
            ids = sorted(json.loads(fields[b"meta"])["id"] for _entry, fields in entries)
            assert ids == sorted(envelope.id for envelope in sent)


async def test_many_envelopes_in_one_publish_are_one_script_call_in_order(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    """publish(topic, 200 envelopes): one PUBLISH script call (one round trip), every
    envelope in the stream when it returns, in order, exactly once."""
    from asyncbus.transports import _redis_scripts

    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        await transport._bindings.bind("many.*", "g")
        client: Any = transport._client
        publish_sha = client.register_script(_redis_scripts.PUBLISH).sha
        calls: list[tuple[Any, ...]] = []
        execute = client.execute_command

        async def counting(*args: Any, **options: Any) -> Any:
            calls.append(args)
            return await execute(*args, **options)

        client.execute_command = counting
        sent = _envelopes("many.x", 200)
        reached = await transport.publish_routed("many.x", sent)
        scripts = [args for args in calls if args[0] in ("EVALSHA", "EVAL")]
        assert [args[1] for args in scripts] == [publish_sha]
        assert reached == ("many.*@g",)
        entries = await redis.xrange(_stream_key(transport, "many.*", "g"))
    assert [json.loads(fields[b"meta"])["id"] for _entry, fields in entries] == [
        envelope.id for envelope in sent
    ]


async def test_one_write_of_publishes_to_different_streams_routes_each_in_order(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    """Runs of publishes to the same streams share one group of the script's arguments;
    a batch mixing topics (and one no group takes) still lands each envelope where it
    belongs, once, in publish order."""
    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        await transport._bindings.bind("mix.a", "exact")
        await transport._bindings.bind("mix.*", "any")
        batches: list[int] = []
        write = transport._publisher.write

        async def counting_write(batch: list[Any]) -> None:
            batches.append(len(batch))
            await write(batch)

        transport._publisher.writes._write = counting_write
        topics = ["mix.a", "mix.a", "mix.b", "nobody", "mix.b", "mix.a", "mix.c", "mix.c"]
        sent = [Envelope(topic=topic, payload=n) for n, topic in enumerate(topics)]
        async with anyio.create_task_group() as task_group:
            for envelope in sent:  # asyncio runs them in this order: one batch, in order
                task_group.start_soon(transport.publish, envelope.topic, [envelope])
        assert batches == [len(sent)]

        async def ids(pattern: str, group: str) -> list[str]:
            entries = await redis.xrange(_stream_key(transport, pattern, group))
            return [json.loads(fields[b"meta"])["id"] for _entry, fields in entries]

        assert await ids("mix.a", "exact") == [e.id for e in sent if e.topic == "mix.a"]
        assert await ids("mix.*", "any") == [e.id for e in sent if e.topic != "nobody"]


async def test_commands_packed_by_hiredis_are_the_bytes_redis_py_packs() -> None:
    """The packing shortcut changes nothing on the wire, nor which arguments fail."""
    pytest.importorskip("hiredis")
    from redis.asyncio.connection import Connection
    from redis.exceptions import DataError

    from asyncbus.transports._redis_connection import packing_by_hiredis

    packed_class = packing_by_hiredis(Connection)
    assert packed_class is not Connection
    ours, theirs = packed_class(), Connection()
    for args in [
        ("PING",),
        ("CONFIG GET", "maxmemory"),
        (b"CLIENT SETNAME", b"x"),
        ("XADD", "s:é", "*", "meta", b'{"id":"a"}', "body", b"\x00\xff" * 5000),
        ("EVALSHA", "a" * 40, 2, "k1", "k2", -3, 0, 12.5, 1e-7, 2**70, "ünïcode"),
        ("ZADD", "z", 1764790000123, "member"),
    ]:
        assert b"".join(ours.pack_command(*args)) == b"".join(theirs.pack_command(*args))
    for bad in (True, None, object()):
        with pytest.raises(DataError):
            theirs.pack_command("SET", "k", bad)
        with pytest.raises(DataError):
            ours.pack_command("SET", "k", bad)


async def test_an_envelope_over_max_message_size_is_refused_and_nothing_is_written(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    async with RedisTransport(redis_url, prefix=clean_prefix, max_message_size=1000) as transport:
        await transport._bindings.bind("sized", "g")
        small, huge = (
            Envelope(topic="sized", payload="s"),
            Envelope(topic="sized", payload="x" * 1000),
        )
        with pytest.raises(
            TransportError, match=rf"envelope {huge.id} .* over max_message_size=1000"
        ):
            await transport.publish("sized", [small, huge])
        assert await redis.xlen(_stream_key(transport, "sized", "g")) == 0
        await transport.publish("sized", [small])
        assert await redis.xlen(_stream_key(transport, "sized", "g")) == 1


@pytest.mark.parametrize("size", [0, -1, 1.5])
def test_max_message_size_must_be_a_positive_int(size: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_message_size must be an int > 0"):
        RedisTransport(max_message_size=size)


async def test_pattern_and_group_with_separators_get_distinct_streams(
    redis_url: str, clean_prefix: str
) -> None:
    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        assert _stream_key(transport, "a@b", "c") != _stream_key(transport, "a", "b@c")
        assert _stream_key(transport, "a%40b", "c") != _stream_key(transport, "a@b", "c")
        async with (
            transport.subscribe("x.>", group="a@b", prefetch=5) as first,
            transport.subscribe("x.>", group="a%40b", prefetch=5) as second,
        ):
            sent = Envelope(topic="x.y", payload="p")
            await transport.publish("x.y", [sent])
            for deliveries in (first, second):
                delivery = await _next(deliveries)
                assert delivery.envelope.id == sent.id
                await delivery.ack()
                await _nothing_within(deliveries)


async def test_group_is_recreated_when_its_stream_vanishes(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    """A server that lost the stream (restart without persistence, flush) is recovered."""
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as transport,
        transport.subscribe("vanish", group="g", prefetch=5) as deliveries,
    ):
        await redis.delete(_stream_key(transport, "vanish", "g"))
        sent = Envelope(topic="vanish", payload=1)
        await transport.publish("vanish", [sent])
        delivery = await _next(deliveries)
        assert delivery.envelope.id == sent.id
        await delivery.ack()


# -- settling -------------------------------------------------------------------------


async def test_ack_removes_the_entry_from_the_stream(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as transport,
        transport.subscribe("acked", group="g", prefetch=5) as deliveries,
    ):
        stream = _stream_key(transport, "acked", "g")
        await transport.publish("acked", _envelopes("acked", 3))
        for _ in range(3):
            await (await _next(deliveries)).ack()
    # Closing writes the acks that were still queued.
    assert await redis.xlen(stream) == 0
    assert (await redis.xpending(stream, "g"))["pending"] == 0


async def test_delayed_nack_waits_in_the_sorted_set_then_returns(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    delay = 1.0
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as transport,
        transport.subscribe("later", group="g", prefetch=1) as deliveries,
    ):
        sent = Envelope(topic="later", payload="p")
        await transport.publish("later", [sent])
        delivery = await _next(deliveries)
        # Due times are wall-clock milliseconds shared by every process: measure with
        # the clock they are kept in (the monotonic clock may drift from it).
        started = time.time()
        await delivery.nack(delay=delay)
        stream = _stream_key(transport, "later", "g")
        assert await redis.zcard(f"{clean_prefix}:delayed") == 1
        assert await redis.xlen(stream) == 0
        assert await transport.backlog("later", "g") == 1
        again = await _next(deliveries, delay + 2.0)
        assert time.time() - started >= delay
        assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
        assert await redis.zcard(f"{clean_prefix}:delayed") == 0
        await again.ack()


async def test_delayed_retry_is_moved_back_by_another_process(
    redis_url: str, clean_prefix: str
) -> None:
    """A retry delayed by a process that then stops is delivered by the next one."""
    sent = Envelope(topic="later", payload="p")
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as first,
        first.subscribe("later", group="g", prefetch=1) as deliveries,
    ):
        await first.publish("later", [sent])
        await (await _next(deliveries)).nack(delay=0.5)
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as second,
        second.subscribe("later", group="g", prefetch=1) as deliveries,
    ):
        again = await _next(deliveries, 5.0)
        assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
        await again.ack()
        await _backlog_becomes_zero(second, "later", "g")


async def test_leaving_hands_back_entries_without_counting_an_attempt(
    redis_url: str, clean_prefix: str
) -> None:
    """Handed-back entries come back first, in order, with the attempt they had."""
    sent = _envelopes("leave", 5)
    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        async with transport.subscribe("leave", group="g", prefetch=3) as leaving:
            await transport.publish("leave", sent)
            taken = [await _next(leaving) for _ in range(3)]
        assert [d.envelope.id for d in taken] == [e.id for e in sent[:3]]
        with pytest.raises(TransportError):
            await taken[0].ack()  # released with the subscription
        async with transport.subscribe("leave", group="g", prefetch=5) as survivor:
            got = [await _next(survivor, 3.0) for _ in range(5)]
            assert [d.envelope.id for d in got] == [e.id for e in sent]
            assert [d.envelope.attempt for d in got] == [1] * 5
            for delivery in got:
                await delivery.ack()
            await _nothing_within(survivor)


async def test_unreadable_metadata_is_delivered_with_an_error(
    redis_url: str, clean_prefix: str, redis: Any
) -> None:
    """An entry written by something else is handed over to be rejected, not stuck."""
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as transport,
        transport.subscribe("foreign", group="g", prefetch=1) as deliveries,
    ):
        await redis.xadd(_stream_key(transport, "foreign", "g"), {"meta": b"{nope", "body": b"x"})
        delivery = await _next(deliveries)
        assert delivery.error is not None
        assert "metadata" in delivery.error
        assert delivery.envelope.payload == b"x"
        await delivery.reject(DeadLetterReason.REJECTED.value, error=delivery.error)
        [entry] = await transport.dead_letters()
        assert entry.envelope.payload == b"x"
        assert await transport.backlog("foreign", "g") == 0


# -- crash recovery ---------------------------------------------------------------------


async def test_killed_consumer_process_entries_reach_a_survivor_within_ack_timeout(
    redis_url: str, clean_prefix: str, workers: list[_Worker]
) -> None:
    """``kill -9`` of a consumer holding entries: a survivor gets them as attempt 2."""
    sent = _envelopes("crash", 3)
    worker = await _start_worker(redis_url, clean_prefix, "crash", "g", 3, "hold")
    workers.append(worker)
    async with RedisTransport(redis_url, prefix=clean_prefix, ack_timeout=ACK_TIMEOUT) as t:
        await t.publish("crash", sent)
        held = [await worker.line() for _ in range(3)]
        assert sorted(line["id"] for line in held) == sorted(e.id for e in sent)
        async with t.subscribe("crash", group="g", prefetch=10) as survivor:
            worker.kill()
            killed = time.monotonic()
            got = [await _next(survivor, ACK_TIMEOUT + 1.0) for _ in range(3)]
            elapsed = time.monotonic() - killed
            assert elapsed <= ACK_TIMEOUT + 1.0, elapsed
            assert sorted(d.envelope.id for d in got) == sorted(e.id for e in sent)
            assert [d.envelope.attempt for d in got] == [2, 2, 2]
            for delivery in got:
                await delivery.ack()
            await _nothing_within(survivor, ACK_TIMEOUT + 0.5)
        await _backlog_becomes_zero(t, "crash", "g")


async def test_entry_held_past_ack_timeout_is_not_delivered_twice_to_its_process(
    redis_url: str, clean_prefix: str
) -> None:
    """Reclaiming finds the entry still held here (queued locally): no second delivery."""
    async with (
        RedisTransport(redis_url, prefix=clean_prefix, ack_timeout=0.3) as transport,
        transport.subscribe("slow", group="g", prefetch=5) as deliveries,
    ):
        await transport.publish("slow", [Envelope(topic="slow", payload=1)])
        held = await _next(deliveries)
        await _nothing_within(deliveries, 1.2)
        await held.ack()


@pytest.mark.parametrize("keep_alive", [False, True])
async def test_keep_alive_keeps_a_held_entry_from_other_consumers(
    redis_url: str, clean_prefix: str, keep_alive: bool
) -> None:
    """Held past ack_timeout: another consumer takes it, unless the holder keeps it alive."""
    async with (
        RedisTransport(
            redis_url, prefix=clean_prefix, ack_timeout=0.6, keep_alive=keep_alive
        ) as holder,
        RedisTransport(redis_url, prefix=clean_prefix, ack_timeout=0.6) as other,
        holder.subscribe("held", group="g", prefetch=5) as held_deliveries,
    ):
        sent = Envelope(topic="held", payload=1)
        await holder.publish("held", [sent])
        held = await _next(held_deliveries)
        async with other.subscribe("held", group="g", prefetch=5) as other_deliveries:
            if keep_alive:
                await _nothing_within(other_deliveries, 2.0)  # more than 3 x ack_timeout
                await held.ack()
            else:
                taken = await _next(other_deliveries)
                assert (taken.envelope.id, taken.envelope.attempt) == (sent.id, 2)
                await taken.ack()
        await _backlog_becomes_zero(holder, "held", "g")


async def test_two_processes_split_the_work_without_loss_or_duplicates(
    redis_url: str, clean_prefix: str, workers: list[_Worker]
) -> None:
    count = 2000
    for _ in range(2):
        workers.append(await _start_worker(redis_url, clean_prefix, "split", "g", 50, "ack"))
    seen: dict[str, list[str]] = {"0": [], "1": []}

    async def read(index: int) -> None:
        while True:
            seen[str(index)].append((await workers[index].line())["id"])

    async with RedisTransport(redis_url, prefix=clean_prefix) as transport:
        sent = _envelopes("split", count)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, 0)
            tg.start_soon(read, 1)
            for start in range(0, count, 100):
                await transport.publish("split", sent[start : start + 100])
            with anyio.fail_after(30):
                while len(seen["0"]) + len(seen["1"]) < count:
                    await anyio.sleep(0.05)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
    both = seen["0"] + seen["1"]
    assert len(both) == count
    assert sorted(both) == sorted(e.id for e in sent)
    assert seen["0"] and seen["1"], "one process got nothing"


# -- a server that restarts ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def _start_server(port: int, directory: Path) -> Process:
    process = await anyio.open_process(
        [
            shutil.which("redis-server") or "redis-server",
            *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)),
            *("--appendonly", "yes", "--appendfsync", "always", "--save", ""),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with anyio.fail_after(10):
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return process
            except OSError:
                await anyio.sleep(0.05)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
async def test_consumer_resumes_after_the_server_restarts(tmp_path: Path) -> None:
    """Confirmed publishes survive a restart of the server; the consumer reconnects."""
    port = _free_port()
    server = await _start_server(port, tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    confirmed: list[int] = []
    got: list[int] = []
    try:
        async with (
            RedisTransport(url, prefix="restart") as transport,
            transport.subscribe("work", group="g", prefetch=10) as deliveries,
            anyio.create_task_group() as tg,
        ):

            async def consume() -> None:
                async for delivery in deliveries:
                    got.append(delivery.envelope.payload)
                    await delivery.ack()

            tg.start_soon(consume)
            for n in range(60):
                if n == 20:
                    server.kill()
                    await server.wait()
                if n == 30:
                    server = await _start_server(port, tmp_path)
                try:
                    await transport.publish("work", [Envelope(topic="work", payload=n)])
                except TransportError:
                    continue  # not confirmed: may or may not be delivered
                confirmed.append(n)
                await anyio.sleep(0.01)
            with anyio.fail_after(10):
                while not set(confirmed) <= set(got):
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        assert len(confirmed) >= 40
        assert set(confirmed) <= set(got)
    finally:
        with anyio.CancelScope(shield=True):
            if server.returncode is None:
                server.kill()
            await server.wait()
            await server.aclose()


# -- dead letters ------------------------------------------------------------------------


async def test_dead_letters_survive_a_new_transport_instance(
    redis_url: str, clean_prefix: str
) -> None:
    sent = Envelope(topic="poison", payload={"bad": True})
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as first,
        first.subscribe("poison", group="g", prefetch=1) as deliveries,
    ):
        await first.publish("poison", [sent])
        await (await _next(deliveries)).reject(
            DeadLetterReason.HANDLER_FAILED.value, error="ValueError: x", stage="poison@g"
        )
        added = DeadLetter(
            Envelope(topic="gone", payload=1), DeadLetterReason.EXPIRED, None, None, 1, time.time()
        )
        await first.add_dead_letter(added)
    async with RedisTransport(redis_url, prefix=clean_prefix) as second:
        entries = await second.dead_letters()
        assert [e.envelope.id for e in entries] == [sent.id, added.envelope.id]
        assert (entries[0].reason, entries[0].error, entries[0].stage, entries[0].attempts) == (
            DeadLetterReason.HANDLER_FAILED,
            "ValueError: x",
            "poison@g",
            1,
        )
        await second.remove_dead_letters([sent.id])
        assert [e.envelope.id for e in await second.dead_letters()] == [added.envelope.id]


async def test_backlog_counts_delayed_retries_and_undelivered_entries(
    redis_url: str, clean_prefix: str
) -> None:
    async with (
        RedisTransport(redis_url, prefix=clean_prefix) as transport,
        transport.subscribe("count", group="g", prefetch=1) as deliveries,
    ):
        await transport.publish("count", _envelopes("count", 3))
        assert await transport.backlog("count", "g") == 3
        await (await _next(deliveries)).nack(delay=30.0)
        assert await transport.backlog("count", "g") == 3
        await (await _next(deliveries)).reject(DeadLetterReason.REJECTED.value)
        assert await transport.backlog("count", "g") == 2


# -- the bus over Redis ----------------------------------------------------------------


async def test_bus_over_redis_keeps_an_exact_ledger_and_its_dead_letters(
    redis_url: str, clean_prefix: str
) -> None:
    bus = Bus(transport=RedisTransport(redis_url, prefix=clean_prefix))
    handled: list[int] = []
    audited: list[int] = []
    failed_once: set[int] = set()

    @bus.subscribe("orders.*", group="work", concurrency=4, retry=Retry(max_attempts=3))
    async def work(n: int) -> None:
        if n == 7:
            raise Reject("seven")
        if n % 10 == 3 and n not in failed_once:
            failed_once.add(n)
            raise ValueError("once")
        handled.append(n)

    @bus.subscribe("orders.>", group="audit")
    async def audit(n: int) -> None:
        audited.append(n)

    with anyio.fail_after(30):
        async with bus:
            for n in range(200):
                await bus.publish("orders.created", n)
            await bus.drain()
            stats = bus.statistics()
            work_stage, audit_stage = stats.stage("orders.*@work"), stats.stage("orders.>@audit")
            assert (work_stage.published, work_stage.acked, work_stage.dead_lettered) == (
                200,
                199,
                1,
            )
            assert (audit_stage.published, audit_stage.acked) == (200, 200)
            for stage in (work_stage, audit_stage):
                assert stage.depth == stage.in_flight == 0
    assert sorted(handled) == [n for n in range(200) if n != 7]
    assert sorted(audited) == list(range(200))
    again = Bus(transport=RedisTransport(redis_url, prefix=clean_prefix))
    async with again:
        [entry] = again.dead_letters.list()
        assert (entry.envelope.payload, entry.reason, entry.stage) == (
            7,
            DeadLetterReason.REJECTED,
            "orders.*@work",
        )
