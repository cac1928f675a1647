"""RabbitTransport against a real RabbitMQ (127.0.0.1:5672): the conformance suite and its own.

Every test runs on asyncio only: aio-pika (and its AMQP layer aiormq) is asyncio-only.
Each test uses its own name prefix and deletes everything under it afterwards
(``RabbitTransport.delete_everything``); the module ends with a sweep (``rabbitmqctl``,
when there is one) of anything left under its prefixes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import pytest
from _brokers import publish_verbatim  # type: ignore[import-not-found]
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
from asyncbus.transports.rabbit import (
    META_HEADER,
    RabbitTransport,
    binding_key,
    delay_bucket_ms,
)

pytestmark = pytest.mark.anyio

ACK_TIMEOUT = 2.0
WORKER = Path(__file__).with_name("_rabbit_worker.py")
RABBITMQCTL = shutil.which("rabbitmqctl")
#: Prefixes used by this module, swept at its end.
PREFIXES: set[str] = set()


# -- clean-up -------------------------------------------------------------------------


async def _delete(url: str, queues: set[str], exchanges: set[str]) -> None:
    import aiormq

    connection = await aiormq.connect(url)
    try:
        for queue in sorted(queues):
            channel = await connection.channel()
            await channel.queue_delete(queue)
            await channel.close()
        for exchange in sorted(exchanges):
            channel = await connection.channel()
            await channel.exchange_delete(exchange)
            await channel.close()
    finally:
        await connection.close()


def _rabbitmqctl(*arguments: str) -> str:
    assert RABBITMQCTL is not None
    result = subprocess.run(
        [RABBITMQCTL, *arguments], capture_output=True, text=True, timeout=60, check=True
    )
    return result.stdout


@pytest.fixture(scope="module", autouse=True)
def _sweep() -> Iterator[None]:
    """After the module: delete whatever is left under the prefixes it used."""
    yield
    if RABBITMQCTL is None or not PREFIXES:
        return
    try:
        queues = _rabbitmqctl("list_queues", "-q", "--no-table-headers", "name").splitlines()
        exchanges = _rabbitmqctl("list_exchanges", "-q", "--no-table-headers", "name").splitlines()
    except (OSError, subprocess.SubprocessError):
        return
    ours = tuple(PREFIXES)
    leftovers = (
        {q for q in queues if q.startswith(ours)},
        {e for e in exchanges if e.startswith(ours)},
    )
    if any(leftovers):
        anyio.run(_delete, "amqp://guest:guest@127.0.0.1:5672/", *leftovers)


class Made:
    """Makes transports on one prefix; everything under it is deleted afterwards."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix

    def __call__(self, **options: Any) -> RabbitTransport:
        options.setdefault("prefix", self.prefix)
        options.setdefault("ack_timeout", ACK_TIMEOUT)
        return RabbitTransport(self.url, **options)

    async def clean(self) -> None:
        await RabbitTransport(self.url, prefix=self.prefix).delete_everything()


@pytest.fixture
async def made(rabbit_url: str, unique_prefix: str) -> AsyncIterator[Made]:
    """A factory of transports on ``unique_prefix``, whose names are deleted afterwards."""
    PREFIXES.add(unique_prefix)
    factory = Made(rabbit_url, unique_prefix)
    yield factory
    with anyio.CancelScope(shield=True):
        await factory.clean()


class TestRabbit(TransportSuite):
    """RabbitTransport passes the conformance suite."""

    ack_timeout = ACK_TIMEOUT

    @pytest.fixture
    async def transport(self, made: Made) -> AsyncIterator[Transport]:
        """An entered RabbitTransport with a prefix unique to the test."""
        async with made(ack_timeout=self.ack_timeout) as transport:
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


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    with anyio.fail_after(timeout):
        while not await check():
            await anyio.sleep(0.02)


def _envelopes(topic: str, count: int) -> list[Envelope]:
    return [Envelope(topic=topic, payload={"n": n}) for n in range(count)]


async def _ready_count(url: str, queue: str) -> int | None:
    """Ready messages in ``queue`` (None when it does not exist), from another connection."""
    import aiormq
    import aiormq.exceptions

    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        try:
            declared = await channel.queue_declare(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        return int(declared.message_count or 0)
    finally:
        await connection.close()


class _Worker:
    """A consumer in another process (``_rabbit_worker.py``), read line by line."""

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


@pytest.fixture
def workers() -> Iterator[list[_Worker]]:
    """Worker processes started by the test; killed afterwards."""
    started: list[_Worker] = []
    yield started
    for worker in started:
        if worker.process.returncode is None:
            worker.kill()


async def _start_worker(made: Made, pattern: str, group: str, prefetch: int, mode: str) -> _Worker:
    process = await anyio.open_process(
        [
            sys.executable,
            str(WORKER),
            made.url,
            made.prefix,
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


# -- names and keys -------------------------------------------------------------------


def test_binding_keys_translate_nats_patterns() -> None:
    assert binding_key("orders.created") == "orders.created"
    assert binding_key("orders.*") == "orders.*"
    assert binding_key("*.created") == "*.created"
    # NATS '>' needs one token or more; AMQP '#' alone would also match zero.
    assert binding_key("orders.>") == "orders.*.#"
    assert binding_key(">") == "*.#"
    with pytest.raises(ConfigurationError, match="'#'"):
        binding_key("orders.#")
    with pytest.raises(ConfigurationError):
        binding_key("orders.>.x")
    with pytest.raises(ConfigurationError, match="255"):
        binding_key("x" * 300)


def test_delay_buckets_round_up_by_at_most_a_sixteenth() -> None:
    assert delay_bucket_ms(0.001) == 1
    assert delay_bucket_ms(0.016) == 16
    assert delay_bucket_ms(0.1) == 100
    assert delay_bucket_ms(0.5) == 512
    for seconds in (0.017, 0.25, 0.333, 1.0, 2.7, 30.0, 3600.0):
        ms = delay_bucket_ms(seconds)
        assert seconds * 1000 <= ms <= seconds * 1000 * (1 + 1 / 16) + 1, (seconds, ms)
    # Few queues: 16 buckets per doubling at most.
    assert len({delay_bucket_ms(n / 1000) for n in range(1000, 2000)}) <= 17


def test_queue_names_keep_pattern_and_group_apart() -> None:
    transport = RabbitTransport(prefix="p")
    assert transport.queue_name("a@b", "c") != transport.queue_name("a", "b@c")
    assert transport.queue_name("a+40b", "c") != transport.queue_name("a@b", "c")
    assert transport.queue_name("orders.*", "mailer") == "p.orders.+2A@mailer"
    assert transport.queue_name("a.>", "m:<lambda>") == "p.a.+3E@m:+3Clambda+3E"
    assert transport.queue_name("ü", "g") == "p.+C3+BC@g"
    long = transport.queue_name("x." * 150 + "y", "g")
    assert len(long.encode()) <= 200
    assert long != transport.queue_name("x." * 150 + "z", "g")


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigurationError):
        RabbitTransport(ack_timeout=0)
    with pytest.raises(ConfigurationError):
        RabbitTransport(prefix="amq.mine")
    with pytest.raises(ConfigurationError):
        RabbitTransport(prefix="")


# -- connecting -----------------------------------------------------------------------


async def test_unreachable_server_raises_connect_error_naming_it_without_password() -> None:
    transport = RabbitTransport("amqp://user:s3cret@127.0.0.1:1/", connect_timeout=5)
    with pytest.raises(ConnectError) as caught:
        async with transport:
            pass
    message = str(caught.value)
    assert "127.0.0.1:1" in message
    assert "s3cret" not in message


async def test_wrong_password_raises_connect_error(rabbit_url: str) -> None:
    transport = RabbitTransport("amqp://guest:wrong@127.0.0.1:5672/", connect_timeout=5)
    with pytest.raises(ConnectError) as caught:
        async with transport:
            pass
    assert "wrong" not in str(caught.value)


async def test_missing_rabbit_extra_raises_connect_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "aio_pika", None)
    with pytest.raises(ConnectError, match=r"asyncbus\[rabbit\]"):
        async with RabbitTransport():
            pass


def test_importing_the_transport_does_not_import_the_client() -> None:
    code = (
        "import sys, asyncbus\n"
        "from asyncbus.transports import RabbitTransport\n"
        "RabbitTransport(prefix='x')\n"
        "assert 'aio_pika' not in sys.modules, 'aio_pika was imported'\n"
        "assert 'aiormq' not in sys.modules, 'aiormq was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_using_the_transport_before_entering_it_raises(made: Made) -> None:
    transport = made()
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


def test_trio_is_refused_with_a_clear_error() -> None:
    # ``connect`` checks the running backend first, before any network traffic.
    import trio

    transport = RabbitTransport()
    with pytest.raises(TransportError, match=r"asyncio only .* not trio"):
        trio.run(transport.connect)


# -- routing and settling -------------------------------------------------------------


async def test_a_pattern_rabbitmq_cannot_bind_is_a_configuration_error(made: Made) -> None:
    async with made() as transport:
        with pytest.raises(ConfigurationError, match="'#'"):
            async with transport.subscribe("a.#", group="g", prefetch=1):
                pass
        with pytest.raises(ConfigurationError):
            await transport.publish_to_group("a..b", "g", [Envelope(topic="a")])


async def test_unicode_topics_and_groups_route(made: Made) -> None:
    async with (
        made() as transport,
        transport.subscribe("grüße.*", group="größe <1>", prefetch=5) as deliveries,
    ):
        sent = Envelope(topic="grüße.welt", payload="ü")
        await transport.publish("grüße.welt", [sent])
        delivery = await _next(deliveries)
        assert (delivery.envelope.id, delivery.envelope.topic) == (sent.id, "grüße.welt")
        await delivery.ack()


async def test_tail_wildcard_does_not_match_the_bare_prefix(made: Made) -> None:
    async with made() as transport, transport.subscribe("orders.>", group="g", prefetch=5) as d:
        await transport.publish("orders", [Envelope(topic="orders", payload=0)])
        sent = Envelope(topic="orders.x", payload=1)
        await transport.publish("orders.x", [sent])
        delivery = await _next(d)
        assert delivery.envelope.id == sent.id
        await delivery.ack()
        await _nothing_within(d)


async def test_an_envelope_over_max_message_size_is_refused_and_nothing_is_sent(
    made: Made,
) -> None:
    async with (
        made(max_message_size=1000) as transport,
        transport.subscribe("sized", group="g", prefetch=5) as deliveries,
    ):
        small, huge = (
            Envelope(topic="sized", payload="s"),
            Envelope(topic="sized", payload="x" * 1000),
        )
        with pytest.raises(
            TransportError, match=rf"envelope {huge.id} .* over max_message_size=1000"
        ):
            await transport.publish("sized", [small, huge])
        await transport.publish("sized", [small])
        delivery = await _next(deliveries)
        assert delivery.envelope.id == small.id
        await delivery.ack()
        await _nothing_within(deliveries)
    with pytest.raises(ConfigurationError, match="max_message_size must be an int > 0"):
        RabbitTransport(max_message_size=0)


async def test_ack_is_written_to_the_broker(made: Made, rabbit_url: str) -> None:
    async with made() as transport:
        async with transport.subscribe("acked", group="g", prefetch=5) as deliveries:
            await transport.publish("acked", _envelopes("acked", 3))
            for _ in range(3):
                await (await _next(deliveries)).ack()
        # Leaving wrote the acks that were still queued: nothing came back.
        queue = transport.queue_name("acked", "g")
        assert await _ready_count(rabbit_url, queue) == 0
        assert await transport.backlog("acked", "g") == 0


async def test_delayed_nack_waits_in_a_retry_queue_then_returns(
    made: Made, rabbit_url: str
) -> None:
    delay = 1.0
    async with (
        made() as transport,
        transport.subscribe("later", group="g", prefetch=1) as deliveries,
    ):
        sent = Envelope(topic="later", payload="p", headers={"k": "v"})
        await transport.publish("later", [sent])
        delivery = await _next(deliveries)
        started = time.monotonic()
        await delivery.nack(delay=delay)
        queue = transport.queue_name("later", "g")
        retry = f"{queue}.retry.{delay_bucket_ms(delay)}"
        assert await _ready_count(rabbit_url, retry) == 1
        assert await transport.backlog("later", "g") == 1
        again = await _next(deliveries, delay + 2.0)
        assert time.monotonic() - started >= delay
        assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
        assert dict(again.envelope.headers) == {"k": "v"}
        assert await _ready_count(rabbit_url, retry) == 0
        await again.ack()
        await _eventually(lambda: _backlog_is(transport, "later", "g", 0))


async def _backlog_is(transport: Transport, pattern: str, group: str, expected: int) -> bool:
    return await transport.backlog(pattern, group) == expected


async def test_retry_delays_do_not_wait_behind_longer_ones(made: Made) -> None:
    """A short delay nacked after a long one comes back first (one queue per delay)."""
    async with (
        made() as transport,
        transport.subscribe("later", group="g", prefetch=2) as deliveries,
    ):
        long, short = Envelope(topic="later", payload="long"), Envelope(topic="later", payload="s")
        await transport.publish("later", [long, short])
        first, second = await _next(deliveries), await _next(deliveries)
        assert (first.envelope.id, second.envelope.id) == (long.id, short.id)
        await first.nack(delay=3.0)
        await second.nack(delay=0.2)
        again = await _next(deliveries, 2.0)
        assert again.envelope.id == short.id
        await again.ack()
        later = await _next(deliveries, 5.0)
        assert later.envelope.id == long.id
        await later.ack()


async def test_delayed_retry_is_delivered_after_its_process_left(made: Made) -> None:
    sent = Envelope(topic="later", payload="p")
    async with made() as first, first.subscribe("later", group="g", prefetch=1) as deliveries:
        await first.publish("later", [sent])
        await (await _next(deliveries)).nack(delay=0.5)
    async with made() as second, second.subscribe("later", group="g", prefetch=1) as deliveries:
        again = await _next(deliveries, 5.0)
        assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
        await again.ack()


async def test_leaving_returns_deliveries_as_copies_that_do_not_count_the_hand_back(
    made: Made,
) -> None:
    """Released deliveries go back to the queue as copies (behind what waits there):
    handed back unhandled, they are no delivery, no attempt, and nothing is lost."""
    sent = _envelopes("leave", 5)
    async with made() as transport:
        async with transport.subscribe("leave", group="g", prefetch=3) as leaving:
            await transport.publish("leave", sent)
            taken = [await _next(leaving) for _ in range(3)]
        assert [d.envelope.id for d in taken] == [e.id for e in sent[:3]]
        with pytest.raises(TransportError, match="released"):
            await taken[0].ack()
        async with transport.subscribe("leave", group="g", prefetch=5) as survivor:
            got = [await _next(survivor, 3.0) for _ in range(5)]
            assert [d.envelope.id for d in got[:2]] == [e.id for e in sent[3:]]
            assert sorted(d.envelope.id for d in got[2:]) == sorted(e.id for e in sent[:3])
            assert [d.envelope.attempt for d in got] == [1, 1, 1, 1, 1]
            assert [d.error for d in got] == [None] * 5
            for delivery in got:
                await delivery.ack()
            await _nothing_within(survivor)


async def test_cancelled_consumer_leaves_nothing_stuck(made: Made) -> None:
    """Cancelled by anyio while it waits: its deliveries reach another consumer at once."""
    sent = _envelopes("cancel", 4)
    async with made() as transport:
        async with anyio.create_task_group() as tg:

            async def hold(*, task_status: anyio.abc.TaskStatus[None]) -> None:
                async with transport.subscribe("cancel", group="g", prefetch=4) as deliveries:
                    task_status.started()
                    for _ in range(4):
                        await anext(deliveries)
                    await anyio.sleep_forever()

            await tg.start(hold)
            await transport.publish("cancel", sent)
            await _eventually(lambda: _backlog_is(transport, "cancel", "g", 4))
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        async with transport.subscribe("cancel", group="g", prefetch=4) as survivor:
            got = [await _next(survivor, 2.0) for _ in range(4)]
            assert sorted(d.envelope.id for d in got) == sorted(e.id for e in sent)
            for delivery in got:
                await delivery.ack()


async def test_stuck_delivery_goes_back_and_its_consumer_consumes_again(made: Made) -> None:
    """ack_timeout (keep_alive off) with a single consumer: the overdue delivery returns
    to it as attempt 2."""
    async with (
        made(ack_timeout=0.5, keep_alive=False) as transport,
        transport.subscribe("slow", group="g", prefetch=5) as deliveries,
    ):
        sent = Envelope(topic="slow", payload=1)
        await transport.publish("slow", [sent])
        held = await _next(deliveries)
        await anyio.sleep(1.2)
        with pytest.raises(TransportError, match="ack_timeout"):
            await held.ack()
        again = await _next(deliveries, 3.0)
        assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
        await again.ack()
        await _nothing_within(deliveries)


async def test_unreadable_metadata_is_delivered_with_an_error(made: Made) -> None:
    """A message published by something else is handed over to be rejected, not stuck."""
    import aiormq
    from pamqp.commands import Basic

    async with (
        made() as transport,
        transport.subscribe("foreign", group="g", prefetch=1) as deliveries,
    ):
        connection = await aiormq.connect(made.url)
        try:
            channel = await connection.channel()
            await channel.basic_publish(
                b"x",
                exchange=transport.prefix,
                routing_key="foreign",
                properties=Basic.Properties(headers={META_HEADER: "{nope"}),
            )
            await channel.basic_publish(b"y", exchange=transport.prefix, routing_key="foreign")
        finally:
            await connection.close()
        for body in (b"x", b"y"):
            delivery = await _next(deliveries)
            assert delivery.error is not None
            assert delivery.envelope.payload == body
            assert delivery.envelope.topic == "foreign"
            await delivery.reject(DeadLetterReason.REJECTED.value, error=delivery.error)
        entries = await transport.dead_letters()
        assert [entry.envelope.payload for entry in entries] == [b"x", b"y"]
        await _eventually(lambda: _backlog_is(transport, "foreign", "g", 0))


async def test_oversized_metadata_is_refused_at_publish(made: Made) -> None:
    from asyncbus import EncodeError

    async with made() as transport:
        with pytest.raises(EncodeError, match="header"):
            await transport.publish("big", [Envelope(topic="big", headers={"h": "x" * 70_000})])


# -- dead letters ---------------------------------------------------------------------


def _dead(payload: Any, dead_at: float | None = None) -> DeadLetter:
    return DeadLetter(
        Envelope(topic="dead", payload=payload),
        DeadLetterReason.HANDLER_FAILED,
        "ValueError: x",
        "dead@g",
        3,
        time.time() if dead_at is None else dead_at,
    )


async def test_dead_letters_outlive_the_transport_that_stored_them(made: Made) -> None:
    entries = [_dead(n) for n in range(5)]
    async with made() as first:
        for entry in entries:
            await first.add_dead_letter(entry)
    async with made() as second:
        listed = await second.dead_letters()
        assert [e.envelope.id for e in listed] == [e.envelope.id for e in entries]
        # Listing does not consume them.
        assert len(await second.dead_letters()) == 5
        await second.remove_dead_letters([entries[1].envelope.id])
        assert [e.envelope.payload for e in await second.dead_letters()] == [0, 2, 3, 4]


async def test_dead_letters_read_many_times_are_all_kept_in_order(made: Made) -> None:
    """The dead-letter queue is a quorum queue: each read puts back what it held, which
    the queue counts as a delivery, and no delivery limit is declared, so nothing is
    dropped or dead-lettered however often it is read; a read takes more entries than the
    2,000 a quorum queue gives a consumer without a prefetch; the order stays."""
    entries = [_dead(n) for n in range(2100)]
    ids = [entry.envelope.id for entry in entries]
    with anyio.fail_after(60):
        async with made() as transport:
            await transport.restore_dead_letters(entries)  # (published pipelined)
            assert [e.envelope.id for e in await transport.dead_letters()] == ids
            for _ in range(30):
                listed = await transport.dead_letters()
                assert len(listed) == len(ids)
            assert [e.envelope.id for e in listed] == ids
            assert await _ready_count(made.url, transport.dead_letter_queue) == len(ids)


async def test_many_dead_letters_taken_out_of_order_are_all_taken(made: Made) -> None:
    """The broker's client of a quorum queue sends a few dozen settlements at a time and
    loses those it still holds when the channel closes: taking every other one of 200
    entries (no run of them to ack at once) and then clearing the rest takes them all."""
    entries = [_dead(n) for n in range(200)]
    ids = [entry.envelope.id for entry in entries]
    with anyio.fail_after(60):
        async with made() as transport:
            await transport.restore_dead_letters(entries)
            assert len(await transport.dead_letters()) == len(ids)  # (read and put back)
            taken = await transport.take_dead_letters(ids[1::2])
            assert sorted(e.envelope.id for e in taken) == sorted(ids[1::2])
            assert [e.envelope.id for e in await transport.dead_letters()] == ids[::2]
            await transport.clear_dead_letters()
            assert await transport.dead_letters() == []
            assert await _ready_count(made.url, transport.dead_letter_queue) == 0


async def test_concurrent_readers_of_the_dead_letters_each_see_them_all(made: Made) -> None:
    """The lock queue keeps two processes from splitting the entries between them."""
    entries = [_dead(n) for n in range(30)]
    async with made() as writer:
        for entry in entries:
            await writer.add_dead_letter(entry)
    seen: dict[int, list[str]] = {}
    async with made() as one, made() as two, anyio.create_task_group() as tg:

        async def read(index: int, transport: RabbitTransport) -> None:
            for _ in range(3):
                listed = await transport.dead_letters()
                assert [e.envelope.id for e in listed] == [e.envelope.id for e in entries]
            seen[index] = [e.envelope.id for e in listed]

        tg.start_soon(read, 1, one)
        tg.start_soon(read, 2, two)
    assert seen[1] == seen[2]


async def test_a_dead_letter_reader_that_dies_puts_nothing_out_of_place(made: Made) -> None:
    entries = [_dead(n) for n in range(10)]
    async with made() as transport:
        for entry in entries:
            await transport.add_dead_letter(entry)
        with anyio.move_on_after(0.001):
            await transport.dead_letters()
        listed = await transport.dead_letters()
        assert [e.envelope.id for e in listed] == [e.envelope.id for e in entries]


# -- processes that die, connections that break -----------------------------------------


async def test_killed_consumer_process_deliveries_reach_a_survivor_at_once(
    made: Made, workers: list[_Worker]
) -> None:
    """``kill -9`` of a consumer holding deliveries: the broker gives them to a survivor."""
    sent = _envelopes("crash", 3)
    worker = await _start_worker(made, "crash", "g", 3, "hold")
    workers.append(worker)
    async with made() as transport:
        await transport.publish("crash", sent)
        held = [await worker.line() for _ in range(3)]
        assert sorted(line["id"] for line in held) == sorted(e.id for e in sent)
        async with transport.subscribe("crash", group="g", prefetch=10) as survivor:
            await _nothing_within(survivor)
            worker.kill()
            killed = time.monotonic()
            got = [await _next(survivor, ACK_TIMEOUT) for _ in range(3)]
            elapsed = time.monotonic() - killed
            # Broker-native: the connection drops with the process, no ack_timeout wait.
            assert elapsed < ACK_TIMEOUT, elapsed
            assert sorted(d.envelope.id for d in got) == sorted(e.id for e in sent)
            assert [d.envelope.attempt for d in got] == [2, 2, 2]
            for delivery in got:
                await delivery.ack()
            await _nothing_within(survivor, ACK_TIMEOUT + 0.5)
        await _eventually(lambda: _backlog_is(transport, "crash", "g", 0))


@pytest.mark.timeout(180)
async def test_two_processes_split_10000_messages_without_loss_or_duplicates(
    made: Made, workers: list[_Worker]
) -> None:
    count = 10_000
    for _ in range(2):
        workers.append(await _start_worker(made, "split", "g", 50, "ack"))
    seen: dict[int, list[str]] = {0: [], 1: []}

    async def read(index: int) -> None:
        while True:
            seen[index].append((await workers[index].line(60))["id"])

    async with made() as transport:
        sent = _envelopes("split", count)
        async with anyio.create_task_group() as tg:
            tg.start_soon(read, 0)
            tg.start_soon(read, 1)
            for start in range(0, count, 100):
                await transport.publish("split", sent[start : start + 100])
            with anyio.fail_after(120):
                while len(seen[0]) + len(seen[1]) < count:
                    await anyio.sleep(0.05)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
    both = seen[0] + seen[1]
    assert len(both) == count
    assert sorted(both) == sorted(e.id for e in sent)
    assert seen[0] and seen[1], "one process got nothing"


async def _break_connections(transport: RabbitTransport, how: str) -> None:
    link = transport._links.link
    assert link is not None
    if how == "client":
        # The consuming connection dies under the subscriber; the transport notices
        # and replaces both connections.
        await link.consumer.close()
        return
    output = _rabbitmqctl(
        "list_connections", "-q", "--no-table-headers", "pid", "client_properties"
    )
    names = {f"asyncbus {transport.prefix} publisher", f"asyncbus {transport.prefix} consumer"}
    pids = [
        line.split("\t", 1)[0]
        for line in output.splitlines()
        if any(f'"{name}"' in line for name in names)
    ]
    assert len(pids) == 2, output
    for pid in pids:
        _rabbitmqctl("close_connection", pid, "asyncbus test: connection closed by the broker")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["client", "broker"])
async def test_broken_connection_reconnects_and_loses_nothing_acknowledged(
    made: Made, how: str
) -> None:
    if how == "broker" and RABBITMQCTL is None:
        pytest.skip("rabbitmqctl is not available")
    count = 300
    confirmed: list[str] = []
    received: Counter[str] = Counter()
    async with (
        made(max_backoff=0.5) as transport,
        transport.subscribe("flaky", group="g", prefetch=20) as deliveries,
        anyio.create_task_group() as tg,
    ):

        async def consume() -> None:
            async for delivery in deliveries:
                received[delivery.envelope.id] += 1
                # One that came over the lost connection raises: the broker redelivers it.
                with contextlib.suppress(TransportError):
                    await delivery.ack()

        tg.start_soon(consume)
        for n in range(count):
            envelope = Envelope(topic="flaky", payload=n)
            await transport.publish("flaky", [envelope])
            confirmed.append(envelope.id)
            if n == count // 3:
                link = transport._links.link
                await _break_connections(transport, how)
                # Publishing goes on while it reconnects (publishes wait for it).
                assert link is not None
                with anyio.fail_after(10):
                    await link.lost.wait()
        with anyio.fail_after(30):
            while not set(confirmed) <= set(received):
                await anyio.sleep(0.05)
        assert transport._links.link is not link
        await _eventually(lambda: _backlog_is(transport, "flaky", "g", 0), 15)
        tg.cancel_scope.cancel()
    assert set(received) == set(confirmed)
    duplicates = sum(n - 1 for n in received.values())
    print(f"{how}: {count} confirmed, all received, {duplicates} received twice")


# -- the bus over RabbitMQ --------------------------------------------------------------


async def test_bus_over_rabbit_handles_retries_and_dead_letters_with_an_exact_ledger(
    made: Made,
) -> None:
    bus = Bus(transport=made())
    handled: list[int] = []
    tries: Counter[int] = Counter()

    @bus.subscribe(
        "jobs.*", group="workers", concurrency=4, capacity=50, retry=Retry(3, backoff=0.01)
    )
    async def work(n: int) -> None:
        tries[n] += 1
        if n % 10 == 0 and tries[n] < 2:
            raise Reject("bad job")
        if n % 7 == 0 and tries[n] < 2:
            raise ValueError("flaky")
        handled.append(n)

    with anyio.fail_after(60):
        async with bus:
            for n in range(1, 201):
                assert await bus.publish("jobs.new", n)
            await bus.drain()
            stage = bus.statistics().stage("jobs.*@workers")
            rejected = [n for n in range(1, 201) if n % 10 == 0]
            assert sorted(handled) == [n for n in range(1, 201) if n % 10]
            assert (stage.published, stage.acked, stage.dead_lettered) == (200, 180, 20)
            assert (
                stage.published == stage.acked + stage.dead_lettered + stage.depth + stage.in_flight
            )
            dead = bus.dead_letters.list(reason=DeadLetterReason.REJECTED)
            assert sorted(entry.envelope.payload for entry in dead) == rejected
            # The broker keeps them too: replay one through it (it succeeds this time).
            stored = await bus.transport.dead_letters()  # type: ignore[union-attr]
            assert sorted(entry.envelope.payload for entry in stored) == rejected
            await bus.dead_letters.replay(dead[0].envelope.id)
            await bus.drain()
            assert handled[-1] == dead[0].envelope.payload == 10
            await _eventually(lambda: _stored_count(bus, 19))
            stage = bus.statistics().stage("jobs.*@workers")
            assert (stage.published, stage.acked, stage.dead_lettered) == (201, 181, 20)
        report = await bus.aclose()
    assert report.drained


async def _stored_count(bus: Bus, expected: int) -> bool:
    transport = bus.transport
    assert transport is not None
    return len(await transport.dead_letters()) == expected


async def test_bus_restarts_with_the_dead_letters_the_broker_kept(made: Made) -> None:
    first = Bus(transport=made())

    @first.subscribe("fail", group="g")
    async def fail(n: int) -> None:
        raise ValueError(f"no {n}")

    async with first:
        await first.publish("fail", 1)
        await first.drain()
        assert len(first.dead_letters) == 1
    second = Bus(transport=made())
    async with second:
        [entry] = second.dead_letters.list()
        assert (entry.envelope.payload, entry.reason) == (1, DeadLetterReason.HANDLER_FAILED)
        assert entry.error is not None
        assert entry.error.startswith("ValueError: no 1")


async def test_request_from_another_process_gets_its_reply_through_the_broker(
    made: Made,
) -> None:
    responder, requester = Bus(transport=made()), Bus(transport=made())

    @responder.subscribe("math.add", group="adders")
    async def add(numbers: dict[str, int]) -> int:
        return numbers["a"] + numbers["b"]

    async with responder, requester:
        assert await requester.request("math.add", {"a": 1, "b": 2}, timeout=10) == 3
        assert await requester.request("math.add", {"a": 2, "b": 3}, timeout=10) == 5
        transport = requester.transport
        assert isinstance(transport, RabbitTransport)
        [inbox] = [s.queue for s in transport._subscriptions if "_reply." in s.queue]
    if RABBITMQCTL is not None:
        # The reply inbox is one process's alone: it expires once nobody consumes it.
        listed = _rabbitmqctl("list_queues", "-q", "--no-table-headers", "name", "arguments")
        [line] = [line for line in listed.splitlines() if line.startswith(inbox + "\t")]
        assert "x-expires" in line, line


@pytest.mark.timeout(120)
async def test_bus_over_a_broken_connection_loses_nothing_it_confirmed(made: Made) -> None:
    transport = made(max_backoff=0.5)
    bus = Bus(transport=transport)
    handled: Counter[int] = Counter()

    @bus.subscribe("flaky.items", group="g", concurrency=4, capacity=50)
    async def handle(n: int) -> None:
        handled[n] += 1

    count = 400
    with anyio.fail_after(90):
        async with bus:
            for n in range(count):
                await bus.publish("flaky.items", n)
                if n == count // 2:
                    await _break_connections(transport, "client")
            while set(handled) != set(range(count)):
                await anyio.sleep(0.05)
            await bus.drain()
    duplicates = sum(seen - 1 for seen in handled.values())
    print(f"bus over a broken connection: {count} confirmed, all handled, {duplicates} twice")


async def test_delete_everything_removes_what_every_process_declared(
    made: Made, rabbit_url: str, workers: list[_Worker]
) -> None:
    workers.append(await _start_worker(made, "theirs.*", "other", 1, "ack"))
    async with made() as transport:
        async with transport.subscribe("mine", group="g", prefetch=1) as deliveries:
            await transport.publish("mine", [Envelope(topic="mine", payload=1)])
            await (await _next(deliveries)).nack(delay=0.05)
        await transport.add_dead_letter(_dead(1))
        queues = [
            transport.queue_name("mine", "g"),
            f"{transport.queue_name('mine', 'g')}.retry.{delay_bucket_ms(0.05)}",
            transport.queue_name("theirs.*", "other"),
            transport.dead_letter_queue,
        ]
        for queue in queues:
            assert await _ready_count(rabbit_url, queue) is not None, queue
    workers[0].kill()
    await RabbitTransport(rabbit_url, prefix=made.prefix).delete_everything()
    for queue in queues:
        assert await _ready_count(rabbit_url, queue) is None, queue
    # Again, with nothing left: no error.
    await RabbitTransport(rabbit_url, prefix=made.prefix).delete_everything()


class _Proxy:
    """A TCP proxy to the broker on loopback, whose connections a test can cut for a while."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.down = False
        self.cut = anyio.Event()
        self.connections = 0

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        async with listener:
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            task_status.started()
            await listener.serve(self._handle)

    async def _handle(self, client: anyio.abc.SocketStream) -> None:
        async with client:
            if self.down:
                return  # the "broker" is away: the connection closes at once
            self.connections += 1
            async with (
                await anyio.connect_tcp("127.0.0.1", self.target_port) as upstream,
                anyio.create_task_group() as tg,
            ):

                async def copy(source: anyio.abc.SocketStream, sink: Any) -> None:
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                        async for chunk in source:
                            await sink.send(chunk)
                    tg.cancel_scope.cancel()

                async def cut() -> None:
                    await self.cut.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(copy, client, upstream)
                tg.start_soon(copy, upstream, client)
                tg.start_soon(cut)

    async def outage(self, seconds: float) -> None:
        """Cut every connection and refuse new ones for ``seconds``."""
        self.down = True
        self.cut.set()
        self.cut = anyio.Event()
        await anyio.sleep(seconds)
        self.down = False


@pytest.mark.timeout(120)
async def test_broker_away_for_a_while_publishes_wait_and_nothing_confirmed_is_lost(
    made: Made, rabbit_url: str
) -> None:
    count = 300
    confirmed: list[str] = []
    received: Counter[str] = Counter()
    proxy = _Proxy(urlsplit(rabbit_url).port or 5672)
    async with anyio.create_task_group() as outer:
        await outer.start(proxy.serve)
        url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/"
        async with (
            RabbitTransport(url, prefix=made.prefix, max_backoff=0.5) as transport,
            transport.subscribe("away", group="g", prefetch=20) as deliveries,
            anyio.create_task_group() as tg,
        ):

            async def consume() -> None:
                async for delivery in deliveries:
                    received[delivery.envelope.id] += 1
                    with contextlib.suppress(TransportError):
                        await delivery.ack()

            tg.start_soon(consume)
            for n in range(count):
                envelope = Envelope(topic="away", payload=n)
                await transport.publish("away", [envelope])
                confirmed.append(envelope.id)
                if n == count // 3:
                    tg.start_soon(proxy.outage, 1.5)
            with anyio.fail_after(30):
                while not set(confirmed) <= set(received):
                    await anyio.sleep(0.05)
            await _eventually(lambda: _backlog_is(transport, "away", "g", 0), 15)
            tg.cancel_scope.cancel()
        outer.cancel_scope.cancel()
    assert set(received) == set(confirmed)
    assert proxy.connections >= 4, "the transport did not reconnect"
    duplicates = sum(n - 1 for n in received.values())
    print(f"broker away 1.5 s: {count} confirmed, all received, {duplicates} received twice")
