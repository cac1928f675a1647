"""RabbitMQ end to end: ``Bus(transport=RabbitTransport(...))`` against hand-written aio-pika.

Every side moves the same ``--messages`` messages through the same broker and the same
topology (a durable topic exchange, one durable quorum queue bound to it, persistent
messages, prefetch 100), timed from the first publish until the last message is
handled (and, for asyncbus, settled):

* **asyncbus**: ``Bus(transport=RabbitTransport(...))`` with one subscription
  (``capacity=100``, so prefetch 100) whose async handler counts; 100 publishing tasks
  each ``await bus.publish(...)`` (100 confirms in flight).
* **aio-pika**: what one would write by hand with aio-pika: a publisher-confirms
  channel and 100 publishing tasks each awaiting ``exchange.publish(...)`` (100 in
  flight); a consumer channel with ``prefetch_count=100`` whose callback counts and
  acks in batches (``ack(multiple=True)`` every 50 messages, and the last one).
* **aio-pika pipelined**: the same by hand, publishing 100 at a time: the 100
  publishes of a batch started together and their confirms awaited together
  (``asyncio.gather``), then the next batch; the same consumer.
* **asyncbus batch**: the same Bus and topology, ``PUBLISHERS`` (4) tasks each
  ``await bus.publish_many(TOPIC, chunk)`` of the next 100 in turn (one routed write
  and one wait for the batch's confirms per call); one subscription with
  ``batch=Batch(max_size=100)`` (``capacity=100``, so prefetch 100, concurrency 1 as
  the single row) whose handler counts its list. A few calls in flight, where the
  pipelined loop has one gathered batch: a ``publish_many`` returns only when every
  confirm of its batch came, so one task would leave the channel idle between a
  batch's last confirm and the next batch's first publish; 4 calls keep a few
  batches on the wire without turning it into 100 publishers again.

Runs alternate (every side on every event loop of ``--loops``, then the next round)
so a neighbour's load falls on all; the report gives, per event loop, each side's
median throughput, the spread of its rounds (lowest and highest, relative to the
median), this process's CPU time per message (the broker shares the CPUs: what the
client spends, the broker lacks) and the ratios. With ``--check`` the maintainers'
target is judged too: asyncbus at least 0.85x aio-pika (single publishes) on every
loop (``FAIL`` and exit status 1 when not). A ratio is judged as in every other suite
here: the median of the per-round ratios (each round's sides ran back to back, so a
round's ratio cancels the drift of the shared machine between rounds); the median of
one side over the median of the other is printed beside it. The ratio of asyncbus
batch to aio-pika pipelined is printed (no target). A run that fails is reported, with
exit status 1.

Run: ``python -m asyncbus bench rabbit [--messages N] [--rounds R] [--loops
asyncio,uvloop] [--url URL] [--check]`` (or ``python benchmarks/rabbit_bench.py``).
Skipped with a note (exit status 0) when the broker is not reachable.
"""

from __future__ import annotations

import argparse
import importlib.util
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from asyncbus import Batch, Bus
from asyncbus.transports.rabbit import RabbitTransport

from ._brokers import publish_concurrently  # 100 publishes in flight

URL = "amqp://guest:guest@127.0.0.1:5672/"
PREFETCH = 100
ACK_EVERY = 50
#: Publishes per call (or per gathered batch) on the pipelined sides.
BATCH = 100
#: Publisher tasks of the asyncbus batch side, each ``publish_many`` of ``BATCH`` in turn.
PUBLISHERS = 4
TARGET = 0.85
TOPIC = "bench.items"


@dataclass(frozen=True)
class Run:
    """One timed run: throughput, and this process's CPU time per message (the broker
    runs on the same CPUs, so what the client spends, the broker lacks)."""

    rate: float
    cpu_us: float


@dataclass
class Result:
    """Throughputs (messages per second) of each side, one per round, on one event loop."""

    rounds: dict[str, list[float]] = field(default_factory=dict)
    #: CPU µs per message of this process, per side, one per round.
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def ratio_of(self, side: str, baseline: str) -> float:
        """The median of the per-round ratios of ``side`` to ``baseline`` (the judged one)."""
        return statistics.median(self.per_round(side, baseline))

    def median_over_median(self, side: str, baseline: str) -> float:
        """Median of ``side`` over median of ``baseline`` (printed beside the judged one)."""
        return statistics.median(self.rounds[side]) / statistics.median(self.rounds[baseline])

    def per_round(self, side: str, baseline: str) -> list[float]:
        """``side`` over ``baseline``, round by round."""
        return [a / b for a, b in zip(self.rounds[side], self.rounds[baseline], strict=True)]

    @property
    def ratio(self) -> float:
        """asyncbus single publishes over hand-written aio-pika single publishes."""
        return self.ratio_of("asyncbus", "aio-pika")


async def run_asyncbus(url: str, count: int) -> Run:
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
            started, cpu = time.perf_counter(), time.process_time()
            await publish_concurrently(count, lambda n: bus.publish(TOPIC, n))
            await done.wait()
            await bus.drain()  # settled too, as the other side's last ack
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await transport.delete_everything()
    return Run(count / elapsed, cpu / count * 1e6)


async def run_aio_pika(url: str, count: int) -> Run:
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

        started, cpu = time.perf_counter(), time.process_time()
        await publish_concurrently(count, publish)
        await done.wait()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        await queue.cancel(tag)
        await consuming.queue_delete(queue_name)
        await consuming.exchange_delete(prefix)
    finally:
        await connection.close()
    return Run(count / elapsed, cpu / count * 1e6)


async def run_aio_pika_pipelined(url: str, count: int) -> Run:
    """Messages per second through aio-pika written pipelined by hand: publishes go
    ``BATCH`` at a time, their confirms awaited together; the same consumer."""
    import asyncio

    import aio_pika

    prefix = f"bench-aio-pika-p-{secrets.token_hex(4)}"
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
            int(message.body)
            handled += 1
            if handled % ACK_EVERY == 0 or handled == count:
                await message.ack(multiple=True)
            if handled == count:
                done.set()

        tag = await queue.consume(on_message)

        def message(n: int) -> aio_pika.Message:
            return aio_pika.Message(
                str(n).encode(),
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                message_id=secrets.token_hex(8),
                content_type="application/json",
            )

        started, cpu = time.perf_counter(), time.process_time()
        for first in range(0, count, BATCH):
            await asyncio.gather(
                *(
                    exchange.publish(message(n), TOPIC)
                    for n in range(first, min(first + BATCH, count))
                )
            )
        await done.wait()
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        await queue.cancel(tag)
        await consuming.queue_delete(queue_name)
        await consuming.exchange_delete(prefix)
    finally:
        await connection.close()
    return Run(count / elapsed, cpu / count * 1e6)


async def run_asyncbus_batch(url: str, count: int) -> Run:
    """Messages per second through ``Bus(transport=RabbitTransport(...))`` in batches:
    ``publish_many`` of ``BATCH`` from ``PUBLISHERS`` tasks, one subscription with
    ``batch=Batch(max_size=BATCH)`` counting each list."""
    prefix = f"bench-asyncbus-b-{secrets.token_hex(4)}"
    transport = RabbitTransport(url, prefix=prefix)
    bus = Bus(transport=transport)
    handled = 0
    done = anyio.Event()

    @bus.subscribe(TOPIC, group="bench", capacity=PREFETCH, batch=Batch(max_size=BATCH))
    async def handle(batch: list[int]) -> None:
        nonlocal handled
        handled += len(batch)
        if handled >= count:
            done.set()

    chunks = [list(range(first, min(first + BATCH, count))) for first in range(0, count, BATCH)]
    next_chunk = 0

    async def publisher() -> None:
        nonlocal next_chunk
        while next_chunk < len(chunks):
            chunk = chunks[next_chunk]
            next_chunk += 1
            await bus.publish_many(TOPIC, chunk)

    try:
        async with bus:
            started, cpu = time.perf_counter(), time.process_time()
            async with anyio.create_task_group() as task_group:
                for _ in range(min(PUBLISHERS, len(chunks))):
                    task_group.start_soon(publisher)
            await done.wait()
            await bus.drain()  # settled too, as the other side's last ack
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await transport.delete_everything()
    if handled != count:
        raise RuntimeError(f"handled {handled} messages, expected {count}")
    return Run(count / elapsed, cpu / count * 1e6)


def reachable(url: str) -> bool:
    """Whether the broker's port accepts a TCP connection."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), 1.0):
            return True
    except OSError:
        return False


#: The sides, in the order each round runs them.
SIDES: dict[str, Callable[[str, int], Awaitable[Run]]] = {
    "asyncbus": run_asyncbus,
    "aio-pika": run_aio_pika,
    "aio-pika pipelined": run_aio_pika_pipelined,
    "asyncbus batch": run_asyncbus_batch,
}


def _run_one(side: str, loop: str, url: str, count: int) -> Run:
    """One run of ``side`` on a fresh event loop of kind ``loop``."""
    return anyio.run(
        SIDES[side], url, count, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"}
    )


def run_benchmark(
    url: str = URL, messages: int = 5000, rounds: int = 5, loops: Sequence[str] = ("asyncio",)
) -> dict[str, Result]:
    """Alternate loops and sides ``rounds`` times (after one warm-up of each)."""
    results = {loop: Result() for loop in loops}
    for loop in loops:
        for side in SIDES:
            _run_one(side, loop, url, min(messages, 500))
    for _ in range(rounds):
        for loop in loops:
            for side in SIDES:
                run = _run_one(side, loop, url, messages)
                results[loop].rounds.setdefault(side, []).append(run.rate)
                results[loop].cpu.setdefault(side, []).append(run.cpu_us)
    return results


def _spread(values: list[float]) -> str:
    """Lowest and highest round, as percentages of the median."""
    median = statistics.median(values)
    return f"{min(values) / median - 1:+.0%}/{max(values) / median - 1:+.0%}"


def _ratio_line(result: Result, side: str, baseline: str) -> str:
    """``side / baseline = median of per-round ratios (rounds; median over median)``."""
    rounds = " ".join(f"{r:.2f}" for r in result.per_round(side, baseline))
    return (
        f"  {side} / {baseline} = {result.ratio_of(side, baseline):.2f} "
        f"(per round: {rounds}; median over median "
        f"{result.median_over_median(side, baseline):.2f})"
    )


def report(results: dict[str, Result], messages: int, check: bool = False) -> str:
    """A table per event loop: each side's median, spread and rounds; the ratios."""
    lines: list[str] = []
    for loop, result in results.items():
        lines += [
            f"RabbitMQ end to end on {loop}, {messages} messages, quorum queue, persistent, "
            f"prefetch {PREFETCH}, medians of {len(result.rounds['asyncbus'])} alternating rounds",
            f"  {'':<20} {'median msg/s':>13} {'spread':>9} {'CPU µs/msg':>11}   rounds (msg/s)",
        ]
        for name, values in result.rounds.items():
            rounds = " ".join(f"{value:.0f}" for value in values)
            cpu = statistics.median(result.cpu[name])
            lines.append(
                f"  {name:<20} {statistics.median(values):>13.0f} {_spread(values):>9} "
                f"{cpu:>11.0f}   {rounds}"
            )
        line = _ratio_line(result, "asyncbus", "aio-pika")
        if check:
            line += f" (target >= {TARGET}): {'PASS' if result.ratio >= TARGET else 'FAIL'}"
        lines.append(line)
        lines.append(_ratio_line(result, "asyncbus batch", "aio-pika pipelined") + " (no target)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line: run and print the report; with ``--check``, exit 1 on a missed target."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench rabbit", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--url", default=URL)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--loops",
        default="asyncio,uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="event loops, alternated within each round (asyncio, uvloop)",
    )
    parser.add_argument("--check", action="store_true", help="judge the target too; exit 1 on FAIL")
    options = parser.parse_args(argv)
    loops = [loop.strip() for loop in options.loops.split(",") if loop.strip()]
    if not loops or not set(loops) <= {"asyncio", "uvloop"}:
        parser.error(f"--loops takes asyncio and/or uvloop, got {options.loops!r}")
    if not reachable(options.url):
        print(f"RabbitMQ not reachable at {urlsplit(options.url).netloc.split('@')[-1]}: skipped")
        return 0
    try:
        results = run_benchmark(options.url, options.messages, options.rounds, loops)
    except Exception as error:
        print(f"the RabbitMQ benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(report(results, options.messages, options.check))
    missed = any(result.ratio < TARGET for result in results.values())
    return 1 if options.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
