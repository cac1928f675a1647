"""Poison messages on the real brokers: garbage another client writes into what a bus
consumes is dead-lettered ``rejected`` once, removed from the broker, and the bus
goes on; a message whose handler kills its process is dead-lettered after
``max_deliveries`` deliveries instead of killing processes for ever.

Each broker gets the same cases, written with its own client (not through asyncbus):
meta without a timestamp, headers that are not a mapping, wrong types, NaN and
numbers too big for a float, meta that is not JSON, JSON nested deeper than any parser
recurses, binary garbage, missing fields. Each test ends by starting a second bus on
the same prefix: the broker keeps every dead letter exactly once, and nothing comes
back to be handled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncbus import Bus, DeadLetterReason, Envelope
from asyncbus.transports import Transport
from asyncbus.transports.nats import HEADER_META, NatsTransport
from asyncbus.transports.rabbit import META_HEADER, RabbitTransport
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PATTERN, GROUP = "poison.*", "g"
STAGE = f"{PATTERN}@{GROUP}"
DEEP = 100_000
#: Deep enough for any parser's recursion limit, small enough for a NATS header (64 KiB).
DEEP_META = 20_000
WORKER = Path(__file__).with_name("_poison_worker.py")
#: The workers' ack_timeout (see ``_poison_worker.py``).
ACK_TIMEOUT = 1.0


def _meta(**changes: Any) -> dict[str, Any]:
    return {"id": uuid.uuid4().hex, "topic": "poison.raw", "timestamp": time.time(), **changes}


def _json(value: Any) -> str:
    return json.dumps(value)  # writes NaN and Infinity, as some clients do


#: (meta, body) of every poison case; ``None`` meta: the message has none at all.
CASES: list[tuple[str | bytes | None, bytes]] = [
    (_json({"id": "no-timestamp", "topic": "poison.raw"}), b"1"),
    (_json(_meta(headers=["not", "a", "mapping"])), b"1"),
    (_json(_meta(headers={"k": 7})), b"1"),
    (_json(_meta(attempt="2")), b"1"),
    (_json(_meta(ttl="soon")), b"1"),
    (_json(_meta(slip="next")), b"1"),
    (_json(_meta(timestamp=float("nan"))), b"1"),
    (_json(_meta(timestamp=1e308)).replace("1e+308", "1e999"), b"1"),
    (_json(_meta(attempt=10**40)), b"1"),
    (_json(["a", "list"]), b"1"),
    ("{not json", b"1"),
    (b"\xff\xfe\x00binary meta", b"1"),
    (
        '{"id":"deep","topic":"poison.raw","timestamp":1,"headers":'
        + "[" * DEEP_META
        + "]" * DEEP_META
        + "}",
        b"1",
    ),
    (_json(_meta()), b"[" * DEEP + b"]" * DEEP),
    (_json(_meta()), b"\x00\xff\xfe binary garbage \x80"),
    (_json(_meta()), b'{"unterminated": '),
    (None, b"no meta at all"),
]


def _text(meta: str | bytes) -> str:
    """The meta as a header value (binary garbage as the characters of its bytes)."""
    return meta.decode("latin-1") if isinstance(meta, bytes) else meta


async def _run_bus(transport: Transport, write: Callable[[Transport], Awaitable[None]]) -> None:
    """A bus consuming ``poison.*``: the poison is written, then one good envelope."""
    bus = Bus(transport=transport)
    handled: list[Any] = []

    @bus.subscribe(PATTERN, group=GROUP)
    async def handle(payload: Any) -> None:
        handled.append(payload)

    with anyio.fail_after(60):
        async with bus:
            await write(transport)
            await bus.publish("poison.good", "fine")
            await bus.drain()
            stage = bus.statistics().stage(STAGE)
            assert (stage.published, stage.acked, stage.dead_lettered, handled) == (
                len(CASES) + 1,
                1,
                len(CASES),
                ["fine"],
            )
            assert stage.depth == stage.in_flight == 0
            entries = bus.dead_letters.list()
            assert len(entries) == len(CASES)
            for entry in entries:
                assert entry.reason is DeadLetterReason.REJECTED
                assert entry.stage == STAGE
                assert entry.error
            assert await transport.backlog(PATTERN, GROUP) == 0
    assert handled == ["fine"], handled


async def _check_nothing_returns(transport: Transport) -> None:
    """A second bus on the prefix: each dead letter is kept once, nothing is handled."""
    bus = Bus(transport=transport)
    handled: list[Any] = []

    @bus.subscribe(PATTERN, group=GROUP)
    async def handle(payload: Any) -> None:
        handled.append(payload)

    with anyio.fail_after(30):
        async with bus:
            await bus.drain()
            assert len(bus.dead_letters.list()) == len(CASES)
            assert bus.statistics().stage(STAGE).published == 0
    assert handled == []


# -- Redis ------------------------------------------------------------------------------


async def test_redis_poison_is_dead_lettered_once_and_the_bus_goes_on(
    redis_url: str, redis_prefix: str
) -> None:
    import redis.asyncio as aioredis

    async def write(transport: Transport) -> None:
        assert isinstance(transport, RedisTransport)
        client = aioredis.Redis.from_url(redis_url)
        stream = transport.stream_key(PATTERN, GROUP)
        try:
            for meta, body in CASES:
                fields: dict[str, Any] = {"body": body}
                if meta is not None:
                    fields["meta"] = meta
                await client.xadd(stream, fields)
        finally:
            await client.aclose()

    await _run_bus(RedisTransport(redis_url, prefix=redis_prefix), write)
    await _check_nothing_returns(RedisTransport(redis_url, prefix=redis_prefix))


# -- NATS -------------------------------------------------------------------------------


async def test_nats_poison_is_dead_lettered_once_and_the_bus_goes_on(
    nats_url: str, nats_prefix: str
) -> None:
    import nats

    async def write(transport: Transport) -> None:
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            for meta, body in CASES:
                headers = {"Nats-Msg-Id": uuid.uuid4().hex}
                if meta is not None:
                    headers[HEADER_META] = _text(meta)
                await js.publish(f"{nats_prefix}.poison.raw", body, headers=headers)
        finally:
            await nc.close()

    await _run_bus(NatsTransport(nats_url, prefix=nats_prefix), write)
    await _check_nothing_returns(NatsTransport(nats_url, prefix=nats_prefix))


# -- RabbitMQ ---------------------------------------------------------------------------


async def test_rabbit_poison_is_dead_lettered_once_and_the_bus_goes_on(
    rabbit_url: str, rabbit_prefix: str
) -> None:
    import aiormq
    from pamqp.commands import Basic

    async def write(transport: Transport) -> None:
        connection = await aiormq.connect(rabbit_url)
        try:
            channel = await connection.channel()
            for meta, body in CASES:
                headers = None if meta is None else {META_HEADER: _text(meta)}
                await channel.basic_publish(
                    body,
                    exchange=rabbit_prefix,
                    routing_key="poison.raw",
                    properties=Basic.Properties(headers=headers),
                )
        finally:
            await connection.close()

    await _run_bus(RabbitTransport(rabbit_url, prefix=rabbit_prefix), write)
    await _check_nothing_returns(RabbitTransport(rabbit_url, prefix=rabbit_prefix))


# -- poison that kills its process ------------------------------------------------------

#: A small cap, so the test kills few processes (the default is 10).
MAX_DELIVERIES = 3


class _Worker:
    """A ``_poison_worker.py`` process, read line by line."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._lines = BufferedByteReceiveStream(process.stdout)

    async def line(self, timeout: float = 30.0) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            data = await self._lines.receive_until(b"\n", 1 << 20)
        found: dict[str, Any] = json.loads(data)
        return found

    async def event(self) -> dict[str, Any]:
        """The next line that is not ``ready`` (a redelivery may beat that line)."""
        while (found := await self.line()) == {"ready": True}:
            pass
        return found


@pytest.fixture
async def workers() -> AsyncIterator[list[_Worker]]:
    """Worker processes started by the test; each one still alive is killed after it."""
    started: list[_Worker] = []
    yield started
    with anyio.CancelScope(shield=True), anyio.fail_after(10):
        for worker in started:
            if worker.process.returncode is None:
                worker.process.kill()
            await worker.process.wait()
            await worker.process.aclose()


async def _check_poison_that_kills_its_process(
    kind: str, url: str, prefix: str, transport: Transport, workers: list[_Worker]
) -> None:
    """Each of the first ``MAX_DELIVERIES`` deliveries kills its worker; the next worker
    dead-letters the message on arrival, without running the handler, and lives."""

    async def start(*, ready: bool = False) -> _Worker:
        process = await anyio.open_process(
            [
                sys.executable,
                str(WORKER),
                kind,
                url,
                prefix,
                str(MAX_DELIVERIES),
            ],
            stdout=subprocess.PIPE,
            stderr=None,
        )
        worker = _Worker(process)
        workers.append(worker)
        if ready:
            assert await worker.line() == {"ready": True}
        return worker

    worker = await start(ready=True)  # subscribed: the group exists
    await transport.publish("poison.kill", [Envelope(topic="poison.kill", payload="boom")])
    for delivery in range(1, MAX_DELIVERIES + 1):
        assert await worker.event() == {"handling": delivery}
        with anyio.fail_after(10):
            assert await worker.process.wait() == 3
        worker = await start()
    assert await worker.event() == {
        "dead": "rejected",
        "error": f"delivered {MAX_DELIVERIES + 1} times without being settled "
        f"(max_deliveries={MAX_DELIVERIES}): its consumer may crash on it",
    }
    assert worker.process.returncode is None
    # The worker announces the dead letter as it hands it to the broker: wait for it.
    with anyio.fail_after(10):
        while not (entries := await transport.dead_letters()):
            await anyio.sleep(0.05)
    [entry] = entries
    assert (entry.envelope.payload, entry.reason, entry.stage) == (
        "boom",
        DeadLetterReason.REJECTED,
        STAGE,
    )
    with anyio.fail_after(10):
        while await transport.backlog(PATTERN, GROUP):
            await anyio.sleep(0.05)


async def test_redis_poison_that_kills_its_process_is_dead_lettered_after_max_deliveries(
    redis_url: str, redis_prefix: str, workers: list[_Worker]
) -> None:
    async with RedisTransport(redis_url, prefix=redis_prefix) as transport:
        await _check_poison_that_kills_its_process(
            "redis", redis_url, redis_prefix, transport, workers
        )


async def test_nats_poison_that_kills_its_process_is_dead_lettered_after_max_deliveries(
    nats_url: str, nats_prefix: str, workers: list[_Worker]
) -> None:
    async with NatsTransport(nats_url, prefix=nats_prefix) as transport:
        await _check_poison_that_kills_its_process(
            "nats", nats_url, nats_prefix, transport, workers
        )


async def test_rabbit_poison_that_kills_its_process_is_dead_lettered_after_max_deliveries(
    rabbit_url: str, rabbit_prefix: str, workers: list[_Worker]
) -> None:
    async with RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport:
        await _check_poison_that_kills_its_process(
            "rabbit", rabbit_url, rabbit_prefix, transport, workers
        )


#: The neighbours' case: the unlucky payload kills its process, the others are fine.
UNLUCKY, NEIGHBOURS, NEIGHBOURS_MAX = 13, (1, 2, 3, 4, 5), 2


async def _check_a_death_counts_only_for_the_message_being_handled(
    kind: str, url: str, prefix: str, transport: Transport, workers: list[_Worker]
) -> None:
    """Workers of capacity 8 hold the unlucky message and its neighbours when it kills
    them: each death counts for it alone. It is dead-lettered after exactly
    ``NEIGHBOURS_MAX`` deaths; each neighbour is handled, once."""

    async def start() -> _Worker:
        process = await anyio.open_process(
            [sys.executable, str(WORKER), kind, url, prefix, str(NEIGHBOURS_MAX), str(UNLUCKY)],
            stdout=subprocess.PIPE,
            stderr=None,
        )
        workers.append(_Worker(process))
        return workers[-1]

    worker = await start()
    assert await worker.line() == {"ready": True}  # subscribed: the group exists
    await transport.publish(
        "poison.kill",
        [Envelope(topic="poison.kill", payload=n) for n in (UNLUCKY, *NEIGHBOURS)],
    )
    handled: Counter[int] = Counter()
    deaths: list[dict[str, Any]] = []
    dead: list[dict[str, Any]] = []
    with anyio.fail_after(90):
        while len(set(handled)) + len(dead) < 1 + len(NEIGHBOURS):  # each one's end
            try:
                event = await worker.line()
            except (anyio.EndOfStream, anyio.IncompleteRead):  # it died: the next one
                assert await worker.process.wait() == 3
                worker = await start()
                continue
            if "handled" in event:
                handled[event["handled"]] += 1
            elif "handling" in event:
                deaths.append(event)
            elif "dead" in event:
                dead.append(event)
        # Settled in the broker: nothing is left to come back.
        while await transport.backlog(PATTERN, GROUP):
            await anyio.sleep(0.05)
    assert deaths == [{"handling": 1, "payload": UNLUCKY}, {"handling": 2, "payload": UNLUCKY}]
    assert handled == Counter(NEIGHBOURS)  # each once: a neighbour's death never counted
    assert dead == [
        {
            "dead": "rejected",
            "error": f"delivered {NEIGHBOURS_MAX + 1} times without being settled "
            f"(max_deliveries={NEIGHBOURS_MAX}): its consumer may crash on it",
        }
    ]
    assert worker.process.returncode is None
    [entry] = await transport.dead_letters()
    assert (entry.envelope.payload, entry.reason) == (UNLUCKY, DeadLetterReason.REJECTED)


async def test_a_message_that_kills_its_process_is_dead_lettered_alone_and_its_neighbours_run(
    kind: str, url: str, unique_prefix: str, workers: list[_Worker]
) -> None:
    async with make_transport(kind, url, unique_prefix) as transport:
        await _check_a_death_counts_only_for_the_message_being_handled(
            kind, url, unique_prefix, transport, workers
        )


async def test_nats_a_dead_consumers_redelivery_is_counted_once_however_late_the_next(
    nats_url: str, nats_prefix: str, workers: list[_Worker]
) -> None:
    """A worker dies on a message; the next one starts only after several ack
    timeouts. Meanwhile the dead worker's open pull request must not swallow (and
    count) the redeliveries: the next worker gets delivery 2, not 3 or more."""

    async def start() -> _Worker:
        process = await anyio.open_process(
            [sys.executable, str(WORKER), "nats", nats_url, nats_prefix, "10"],
            stdout=subprocess.PIPE,
            stderr=None,
        )
        workers.append(_Worker(process))
        return workers[-1]

    async with NatsTransport(nats_url, prefix=nats_prefix) as transport:
        worker = await start()
        assert await worker.line() == {"ready": True}
        await transport.publish("poison.kill", [Envelope(topic="poison.kill", payload="boom")])
        assert await worker.event() == {"handling": 1}
        with anyio.fail_after(10):
            assert await worker.process.wait() == 3
        # No consumer for a while: the redeliveries due meanwhile find none (the
        # scenario itself, not a wait for work).
        await anyio.sleep(3 * ACK_TIMEOUT)
        worker = await start()
        assert await worker.event() == {"handling": 2}


async def test_nats_a_plain_message_on_a_pull_inbox_is_ignored(
    nats_url: str, nats_prefix: str
) -> None:
    """Someone publishes to a subscription's private inbox: not a JetStream delivery."""
    import nats

    async with (
        NatsTransport(nats_url, prefix=nats_prefix) as transport,
        transport.subscribe("plain", group="g", prefetch=1) as deliveries,
    ):
        [consumer] = transport._subscriptions.consumers
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            await nc.publish(f"{consumer.inbox}.1", b"junk")
            await nc.flush()
        finally:
            await nc.close()
        await transport.publish("plain", [Envelope(topic="plain", payload=1)])
        with anyio.fail_after(10):
            delivery = await anext(deliveries)
        assert (delivery.envelope.payload, delivery.error) == (1, None)
        await delivery.ack()
