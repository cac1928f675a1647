"""RabbitMQ end to end: ``Bus(transport=RabbitTransport(...))`` against hand-written aio-pika.

Both sides move the same ``--messages`` envelopes through the same broker and the same
topology (a durable topic exchange, one durable quorum queue bound to it, persistent
messages), timed from the first publish until the last message is handled and acked:

* **asyncbus**: ``Bus(transport=RabbitTransport(...))`` with one subscription
  (``capacity=100``, so prefetch 100) whose async handler counts; 100 publishing tasks
  each ``await bus.publish(...)`` (100 confirms in flight).
* **aio-pika**: what one would write by hand with aio-pika: a publisher-confirms
  channel and 100 publishing tasks each awaiting ``exchange.publish(...)`` (100 in
  flight); a consumer channel with ``prefetch_count=100`` whose callback counts and
  acks in batches (``ack(multiple=True)`` every 50 messages, and the last one).

Runs alternate (asyncbus, aio-pika, asyncbus, ...) so a neighbour's load falls on both;
the report gives each side's median throughput and their ratio. With ``--check`` the
maintainers' target is judged too: asyncbus at least 0.6x aio-pika (``FAIL`` and exit
status 1 when not). A run that fails is reported, with exit status 1.

Run: ``python benchmarks/rabbit_bench.py [--messages N] [--rounds R] [--url URL]
[--check]``.
Skipped with a note (exit status 0) when the broker is not reachable.
"""

from __future__ import annotations

import argparse
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from asyncbus import Bus
from asyncbus.transports.rabbit import RabbitTransport

URL = "amqp://guest:guest@127.0.0.1:5672/"
IN_FLIGHT = 100
PREFETCH = 100
ACK_EVERY = 50
TARGET = 0.6
TOPIC = "bench.items"


@dataclass
class Result:
    """Throughputs (messages per second) of each side, one per round."""

    asyncbus: list[float] = field(default_factory=list)
    aio_pika: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.median(self.asyncbus) / statistics.median(self.aio_pika)


async def _publish_concurrently(count: int, publish: Callable[[int], Awaitable[object]]) -> None:
    """``count`` publishes, ``IN_FLIGHT`` at a time (each task awaits its confirm)."""
    next_n = 0

    async def worker() -> None:
        nonlocal next_n
        while next_n < count:
            n = next_n
            next_n += 1
            await publish(n)

    async with anyio.create_task_group() as task_group:
        for _ in range(IN_FLIGHT):
            task_group.start_soon(worker)


async def run_asyncbus(url: str, count: int) -> float:
    """Messages per second through ``Bus(transport=RabbitTransport(...))``."""
    prefix = f"bench-asyncbus-{secrets.token_hex(4)}"
    transport = RabbitTransport(url, prefix=prefix)
    bus = Bus(transport=transport)
    handled = 0
    done = anyio.Event()

    @bus.subscribe(TOPIC, group="bench", capacity=PREFETCH)
    async def handle(n: int) -> None:
        nonlocal handled
        handled += 1
        if handled == count:
            done.set()

    try:
        async with bus:
            started = time.perf_counter()
            await _publish_concurrently(count, lambda n: bus.publish(TOPIC, n))
            await done.wait()
            await bus.drain()  # settled too, as the other side's last ack
            elapsed = time.perf_counter() - started
    finally:
        await transport.delete_everything()
    return count / elapsed


async def run_aio_pika(url: str, count: int) -> float:
    """Messages per second through a hand-written aio-pika publisher and consumer."""
    import aio_pika

    prefix = f"bench-aio-pika-{secrets.token_hex(4)}"
    queue_name = f"{prefix}.bench"
    handled = 0
    done = anyio.Event()
    connection = await aio_pika.connect(url)
    try:
        publishing = await connection.channel(publisher_confirms=True)
        exchange = await publishing.declare_exchange(
            prefix, aio_pika.ExchangeType.TOPIC, durable=True
        )
        consuming = await connection.channel()
        await consuming.set_qos(prefetch_count=PREFETCH)
        queue = await consuming.declare_queue(
            queue_name, durable=True, arguments={"x-queue-type": "quorum"}
        )
        await queue.bind(exchange, TOPIC)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal handled
            int(message.body)  # "handle" it: decode the payload
            handled += 1
            if handled % ACK_EVERY == 0 or handled == count:
                await message.ack(multiple=True)
            if handled == count:
                done.set()

        tag = await queue.consume(on_message)

        async def publish(n: int) -> object:
            return await exchange.publish(
                aio_pika.Message(
                    str(n).encode(),
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    message_id=secrets.token_hex(8),
                    content_type="application/json",
                ),
                TOPIC,
                mandatory=False,
            )

        started = time.perf_counter()
        await _publish_concurrently(count, publish)
        await done.wait()
        elapsed = time.perf_counter() - started
        await queue.cancel(tag)
        await consuming.queue_delete(queue_name)
        await consuming.exchange_delete(prefix)
    finally:
        await connection.close()
    return count / elapsed


def reachable(url: str) -> bool:
    """Whether the broker's port accepts a TCP connection."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 1.0):
            return True
    except OSError:
        return False


async def run_benchmark(url: str = URL, messages: int = 5000, rounds: int = 5) -> Result:
    """Alternate the two sides ``rounds`` times (after one warm-up of each)."""
    result = Result()
    await run_asyncbus(url, min(messages, 500))
    await run_aio_pika(url, min(messages, 500))
    for _ in range(rounds):
        result.asyncbus.append(await run_asyncbus(url, messages))
        result.aio_pika.append(await run_aio_pika(url, messages))
    return result


def report(result: Result, messages: int, check: bool = False) -> str:
    """A small table of both sides, their ratio and (``check``) the verdict."""
    lines = [
        f"RabbitMQ end to end, {messages} messages, {IN_FLIGHT} publishes in flight, "
        f"prefetch {PREFETCH}, quorum queue, medians of {len(result.asyncbus)} rounds",
        f"  {'':<10} {'median msg/s':>13}   rounds",
    ]
    for name, values in (("asyncbus", result.asyncbus), ("aio-pika", result.aio_pika)):
        rounds = " ".join(f"{value:.0f}" for value in values)
        lines.append(f"  {name:<10} {statistics.median(values):>13.0f}   {rounds}")
    line = f"  ratio asyncbus / aio-pika = {result.ratio:.2f}"
    if check:
        line += f" (target >= {TARGET}): {'PASS' if result.ratio >= TARGET else 'FAIL'}"
    lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: run and print the report; with ``--check``, exit 1 on a missed target."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench rabbit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--url", default=URL)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check", action="store_true", help="judge the target too; exit 1 on FAIL")
    options = parser.parse_args(argv)
    if not reachable(options.url):
        print(f"RabbitMQ not reachable at {urlsplit(options.url).netloc.split('@')[-1]}: skipped")
        return 0
    try:
        result = anyio.run(run_benchmark, options.url, options.messages, options.rounds)
    except Exception as error:
        print(f"the RabbitMQ benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(report(result, options.messages, options.check))
    return 1 if options.check and result.ratio < TARGET else 0


if __name__ == "__main__":
    sys.exit(main())
