"""Retrying over a broker: the bus's local timer against the broker's delayed nack.

``python benchmarks/retry_paths.py [--brokers redis,nats,rabbit,postgres]
[--envelopes 300] [--delay 0.2] [--rounds 5] [--json PATH] [--check]``

Every envelope fails its first attempt and succeeds on its second, ``delay`` seconds
later. Three ways of getting there, over each broker reachable on loopback:

* **(a) bus, local timer**: ``Bus(transport=...)``, one subscription with
  ``Retry(max_attempts=2, backoff=delay, jitter=False)``; the handler raises on attempt 1.
  The bus holds the delivery (its claim kept alive) and re-runs the handler on a timer
  in its stage: what a retry over a broker does.
* **(b) raw, broker nack**: the transport alone (``transport.subscribe`` and a task per
  delivery); attempt 1 is handed back with ``await delivery.nack(delay=delay)``, the
  broker's durable delayed redelivery (Redis: a due set moved by one task; NATS: the
  server's ``NAK`` delay; RabbitMQ: a retry queue per delay with a message TTL that
  dead-letters back; PostgreSQL: the row's ``available_at``), and attempt 2 is acked.
* **(c) raw, local hold**: the same loop, attempt 1 held in hand: its task sleeps
  ``delay``, handles it again and acks it. What the bus does, without the bus: (a)
  against (c) is the bus's own cost, (b) against (c) the strategy's.

Each run publishes the ``envelopes`` in one call (``publish_many``; ``transport.publish``)
and is timed from that call until the last second attempt is acked (an ``anyio.Event``
set where the handler, or the raw loop, counts it); **over D** is that time less
``delay``, and **1st pass** the part of it until the last attempt 1 gave up (every
envelope delivered and handled once). The **delay** columns are per envelope: from the
moment attempt 1 gave up (the handler raising, the nack or the hold beginning) to
attempt 2 beginning, p50 and p99 of one run. Attempt 1 is an envelope's first sight in
the run (the bus's ``Retry`` counts ``attempt`` itself). Per broker one prefix (a
PostgreSQL schema) serves every run and is removed at the end; each path has a topic of
its own. The bus is made again for each run; the raw transport stays connected and its
two subscriptions stay open across the runs, as a consumer that runs for long (a
RabbitMQ retry queue is declared once). One untimed run of each path comes first.
Rounds alternate (a b c a b c ...), so a slow spell of the shared machine falls on every
path; figures are medians over the rounds, **x (a)** the median of the per-round ratios
to (a).

After each run ``--quiet`` seconds pass (untimed) to catch a late redelivery; a
delivery of an earlier run's envelope counts as a duplicate. A measurement, not a
target: ``--check`` exits 1 only when a run lost an envelope or handled one more than
twice or acked it more than once. A broker whose port is closed is skipped with a note.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import secrets
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc

from asyncbus import Bus, Envelope, Retry
from asyncbus.transports.base import Delivery, Transport

URLS = {
    "redis": "redis://127.0.0.1:6379/0",
    "nats": "nats://127.0.0.1:4222",
    "rabbit": "amqp://guest:guest@127.0.0.1:5672/",
    "postgres": "postgresql://postgres@127.0.0.1:5432/test",
}
PORTS = {"redis": 6379, "nats": 4222, "rabbit": 5672, "postgres": 5432}
PATHS = {"a": "(a) bus, local timer", "b": "(b) raw, broker nack", "c": "(c) raw, local hold"}
GROUP = "bench"
#: Seconds a run may take beyond its delay before what is missing counts as lost.
PATIENCE = 30.0


class FirstAttemptFails(Exception):
    """What the handler raises on attempt 1."""


def reachable(kind: str) -> bool:
    parts = urlsplit(URLS[kind])
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", PORTS[kind]), 1.0):
            return True
    except OSError:
        return False


def transport(kind: str, name: str) -> Transport:
    """A transport over ``kind`` under prefix (or schema) ``name``."""
    if kind == "redis":
        from asyncbus.transports.redis import RedisTransport

        return RedisTransport(URLS[kind], prefix=name)
    if kind == "nats":
        from asyncbus.transports.nats import NatsTransport

        return NatsTransport(URLS[kind], prefix=name)
    if kind == "rabbit":
        from asyncbus.transports.rabbit import RabbitTransport

        return RabbitTransport(URLS[kind], prefix=name)
    from asyncbus.transports.postgres import PostgresTransport

    return PostgresTransport(URLS[kind], schema=name)


async def forget(kind: str, name: str) -> None:
    """Remove everything a broker's runs left under ``name`` (shielded, bounded)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
        if kind == "redis":
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(URLS[kind])
            try:
                keys = [key async for key in client.scan_iter(match=f"{name}:*")]
                if keys:
                    await client.delete(*keys)
            finally:
                await client.aclose()
        elif kind == "nats":
            import nats
            from nats.js.errors import NotFoundError

            from asyncbus.transports.nats import NatsTransport

            made = NatsTransport(URLS[kind], prefix=name)
            nc = await nats.connect(URLS[kind], allow_reconnect=False, connect_timeout=2)
            try:
                js = nc.jetstream()
                for info in await js.streams_info():
                    stream = info.config.name or ""
                    if stream in (made.stream, made.dead_letter_stream) or stream.startswith(
                        f"KV_{made.stream}_"
                    ):
                        with contextlib.suppress(NotFoundError):
                            await js.delete_stream(stream)
            finally:
                await nc.close()
        elif kind == "rabbit":
            from asyncbus.transports.rabbit import RabbitTransport

            await RabbitTransport(URLS[kind], prefix=name).delete_everything()
        else:
            import asyncpg

            connection = await asyncpg.connect(URLS[kind])
            try:
                await connection.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")
            finally:
                await connection.close()


@dataclass
class Tally:
    """What one run handled and acked, per envelope id, and when.

    Attempt 1 is an envelope's first sight in the run, not ``envelope.attempt == 1``:
    over NATS ``attempt`` is the server's delivery count, which a hand-back (a pull
    request of an ended subscription that still received it) also raises.
    """

    ids: frozenset[str]
    handled: Counter[str] = field(default_factory=Counter)
    acked: Counter[str] = field(default_factory=Counter)
    gave_up: dict[str, float] = field(default_factory=dict)
    delays: list[float] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    #: Deliveries of envelopes of an earlier run (each a duplicate).
    strays: int = 0
    #: When the publish began (``time.perf_counter``).
    began: float = 0.0

    def ours(self, id: str) -> bool:
        """Whether ``id`` is this run's; else it is counted as a stray."""
        if id in self.ids:
            return True
        self.strays += 1
        return False

    def first(self, id: str) -> bool:
        """Whether this is the first sight of ``id`` (attempt 1, which gives up now)."""
        self.handled[id] += 1
        if self.handled[id] > 1:
            return False
        self.gave_up[id] = time.perf_counter()
        return True

    def second(self, id: str) -> None:
        """Attempt 2 begins now (counted by :meth:`first` when held in hand)."""
        self.delays.append(time.perf_counter() - self.gave_up[id])

    def ack(self, id: str) -> None:
        self.acked[id] += 1
        if len(self.acked) == len(self.ids):
            self.done.set()

    def faults(self) -> tuple[int, int]:
        """(lost, duplicated): envelopes never acked; handled or acked too often, strays."""
        lost = len(self.ids) - len(self.acked)
        duplicated = sum(1 for id, times in self.handled.items() if times > 2 or self.acked[id] > 1)
        return lost, duplicated + self.strays


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def result(tally: Tally, elapsed: float, extra_lost: int = 0, extra_dup: int = 0) -> dict[str, Any]:
    lost, duplicated = tally.faults()
    return {
        "time": elapsed,
        "first_pass": max(tally.gave_up.values(), default=tally.began) - tally.began,
        "delay_p50": quantile(tally.delays, 0.50),
        "delay_p99": quantile(tally.delays, 0.99),
        "lost": max(lost, extra_lost),
        "duplicated": max(duplicated, extra_dup),
    }


async def bus_run(kind: str, name: str, topic: str, options: argparse.Namespace) -> dict[str, Any]:
    """(a): the bus's Retry over ``kind``, a new bus (and transport) under ``name``."""
    count, delay = options.envelopes, options.delay
    payloads = [secrets.token_hex(8) for _ in range(count)]
    tally = Tally(frozenset(payloads))

    async def handle(envelope: Envelope) -> None:
        key = envelope.payload  # (the envelope's id is made by the publish)
        if not tally.ours(key):
            return
        if tally.first(key):
            raise FirstAttemptFails(key)
        tally.second(key)
        tally.ack(key)  # (the bus acks it as the handler returns)

    bus = Bus(transport=transport(kind, name))
    retry = Retry(max_attempts=2, backoff=delay, jitter=False)
    bus.subscribe(
        topic, handle, group=GROUP, concurrency=16, capacity=options.prefetch, middleware=[retry]
    )
    async with bus:
        began = tally.began = time.perf_counter()
        await bus.publish_many(topic, payloads)
        with anyio.move_on_after(delay + PATIENCE):
            await tally.done.wait()
        elapsed = time.perf_counter() - began
        with anyio.move_on_after(PATIENCE):
            await bus.drain()
        await anyio.sleep(options.quiet)  # (untimed: a late redelivery would show)
        stage = bus.statistics().stage(f"{topic}@{GROUP}")
    lost = count - stage.acked + stage.dead_lettered
    return result(tally, elapsed, max(lost, 0), max(stage.acked - count, 0))


class RawConsumer:
    """(b) (``hold`` false) or (c): one subscription of the raw transport, open across
    the runs (as a consumer that runs for long), a task per delivery, settled by the
    rule of the run under way."""

    def __init__(self, raw: Transport, topic: str, hold: bool, options: argparse.Namespace):
        self.raw = raw
        self.topic = topic
        self.hold = hold
        self.options = options
        self.tally = Tally(frozenset())

    async def consume(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        raw, options = self.raw, self.options
        subscription = raw.subscribe(self.topic, group=GROUP, prefetch=options.prefetch)
        async with subscription as deliveries, anyio.create_task_group() as settles:
            task_status.started()
            async for delivery in deliveries:
                settles.start_soon(self.settle, delivery)

    async def settle(self, delivery: Delivery) -> None:
        tally, id = self.tally, delivery.envelope.id
        if not tally.ours(id):
            await delivery.ack()
            return
        if tally.first(id):
            if not self.hold:
                await delivery.nack(delay=self.options.delay)
                return
            await anyio.sleep(self.options.delay)
            tally.handled[id] += 1
        tally.second(id)
        await delivery.ack()
        tally.ack(id)

    async def run(self) -> dict[str, Any]:
        """One run: publish the envelopes, time until every one is acked."""
        envelopes = [Envelope(topic=self.topic, payload=n) for n in range(self.options.envelopes)]
        tally = self.tally = Tally(frozenset(envelope.id for envelope in envelopes))
        began = tally.began = time.perf_counter()
        await self.raw.publish(self.topic, envelopes)
        with anyio.move_on_after(self.options.delay + PATIENCE):
            await tally.done.wait()
        elapsed = time.perf_counter() - began
        await anyio.sleep(self.options.quiet)  # (untimed: a late redelivery would show)
        return result(tally, elapsed)


async def broker_rounds(
    kind: str, options: argparse.Namespace
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]:
    """Every round of the three paths over ``kind``, and the untimed run of each first."""
    name = f"bench_retry_{secrets.token_hex(4)}"
    rounds: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    warm_ups: dict[str, dict[str, Any]] = {}
    try:
        async with transport(kind, name) as raw, anyio.create_task_group() as consumers:
            nacking = RawConsumer(raw, "retry.nack", False, options)
            holding = RawConsumer(raw, "retry.hold", True, options)
            await consumers.start(nacking.consume)
            await consumers.start(holding.consume)
            runs: dict[str, Callable[[], Any]] = {
                "a": lambda: bus_run(kind, name, "retry.bus", options),
                "b": nacking.run,
                "c": holding.run,
            }
            for round_ in range(options.rounds + 1):
                for path, run in runs.items():
                    outcome = await run()
                    if round_:
                        rounds[path].append(outcome)
                    else:
                        warm_ups[path] = outcome
            consumers.cancel_scope.cancel()
    finally:
        await forget(kind, name)
    return rounds, warm_ups


def summary(
    results: list[dict[str, Any]], base: list[dict[str, Any]], warm_up: dict[str, Any]
) -> dict[str, float]:
    """Medians over the rounds; faults are the worst run's, the untimed one's included."""
    times = [r["time"] for r in results]
    ratios = [r["time"] / b["time"] for r, b in zip(results, base, strict=True)]
    return {
        "time": statistics.median(times),
        "time_min": min(times),
        "time_max": max(times),
        "first_pass": statistics.median(r["first_pass"] for r in results),
        "delay_p50": statistics.median(r["delay_p50"] for r in results),
        "delay_p99": statistics.median(r["delay_p99"] for r in results),
        "x_a": statistics.median(ratios),
        "lost": max(r["lost"] for r in [*results, warm_up]),
        "duplicated": max(r["duplicated"] for r in [*results, warm_up]),
    }


async def run(
    options: argparse.Namespace,
) -> tuple[dict[str, dict[str, dict[str, float]]], list[str]]:
    figures: dict[str, dict[str, dict[str, float]]] = {}
    notes = []
    for kind in options.brokers.split(","):
        if not reachable(kind):
            notes.append(f"{kind}: skipped, nothing listens on 127.0.0.1:{PORTS[kind]}")
            continue
        rounds, warm_ups = await broker_rounds(kind, options)
        figures[kind] = {path: summary(rounds[path], rounds["a"], warm_ups[path]) for path in PATHS}
    return figures, notes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="redis,nats,rabbit,postgres")
    parser.add_argument("--envelopes", type=int, default=300)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefetch", type=int, help="prefetch and capacity (default: envelopes)")
    parser.add_argument("--quiet", type=float, default=0.3, help="seconds to wait for strays")
    parser.add_argument("--json")
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args(argv)
    unknown = set(options.brokers.split(",")) - set(URLS)
    if unknown:
        parser.error(f"unknown brokers: {', '.join(sorted(unknown))}")
    options.prefetch = options.prefetch or options.envelopes
    # A first attempt fails on purpose: the bus would log each one.
    logging.getLogger("asyncbus").setLevel(logging.CRITICAL)
    figures, notes = anyio.run(run, options)
    d = options.delay
    print(
        f"retry paths: {options.envelopes} envelopes each failing attempt 1, retried after "
        f"D = {d * 1000:.0f} ms; median of {options.rounds} rounds (ms)"
    )
    print(
        f"{'broker':<10}{'path':<23}{'time':>8}{'min-max':>15}{'over D':>9}{'1st pass':>10}"
        f"{'delay p50':>11}{'p99':>8}{'x (a)':>7}{'lost':>6}{'dup':>5}"
    )
    failed = []
    for kind, paths in figures.items():
        for path, f in paths.items():
            spread = f"{f['time_min'] * 1000:.0f}-{f['time_max'] * 1000:.0f}"
            print(
                f"{kind if path == 'a' else '':<10}{PATHS[path]:<23}{f['time'] * 1000:>8.1f}"
                f"{spread:>15}{(f['time'] - d) * 1000:>9.1f}{f['first_pass'] * 1000:>10.1f}"
                f"{f['delay_p50'] * 1000:>11.1f}"
                f"{f['delay_p99'] * 1000:>8.1f}{f['x_a']:>7.2f}{f['lost']:>6.0f}"
                f"{f['duplicated']:>5.0f}"
            )
            if f["lost"] or f["duplicated"]:
                failed.append(f"{kind} {PATHS[path]}")
    for note in notes:
        print(note)
    print(
        "every envelope handled twice and acked once: "
        + ("yes" if not failed else f"NO ({'; '.join(failed)})")
    )
    if options.json:
        with open(options.json, "w") as out:
            json.dump({"options": vars(options), "figures": figures}, out, indent=2)
    return 1 if failed and options.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
