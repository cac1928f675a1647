"""A rate limit shared by several processes over a broker: how close the group keeps it.

``python benchmarks/rate_limit.py [--transport redis|nats|postgres] [--rate 500]
[--processes 3] [--seconds 30] [--json PATH] [--check]``

A backlog far larger than the limit allows is published first; then ``processes``
worker processes (spawned, each its own bus and connection) consume one group, each
stage under ``RateLimit(rate)``. Each worker records when it handled each envelope;
the rate is what the whole group handled per second over the measured window (from
two seconds after the first handling, so the start-up burst is left out). The baseline
in the same run is what the same workers would reach if each limited on its own:
``rate x processes`` (the limit per process, the fallback where the broker keeps no
turns). Target: the group's rate within 5 % of ``rate`` (``--check`` exits 1
otherwise, or when an envelope is handled twice).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
import uuid
from typing import Any

import anyio

from asyncbus import Bus, Envelope, RateLimit

TOLERANCE = 0.05
URLS = {
    "redis": "redis://127.0.0.1:6379/0",
    "nats": "nats://127.0.0.1:4222",
    "postgres": "postgresql://postgres@127.0.0.1:5432/test",
}
#: Seconds after the first handling that the measured window begins.
WARM_UP = 2.0


def _schema(prefix: str) -> str:
    """``prefix`` as a PostgreSQL schema name."""
    return prefix.replace("-", "_")


def _transport(kind: str, prefix: str) -> Any:
    if kind == "redis":
        from asyncbus.transports.redis import RedisTransport

        return RedisTransport(URLS[kind], prefix=prefix)
    if kind == "postgres":
        from asyncbus.transports.postgres import PostgresTransport

        return PostgresTransport(URLS[kind], schema=_schema(prefix))
    from asyncbus.transports.nats import NatsTransport

    return NatsTransport(URLS[kind], prefix=prefix)


def _bus(kind: str, prefix: str, rate: float, handled: list[tuple[float, int]]) -> Bus:
    bus = Bus(transport=_transport(kind, prefix))

    async def send(envelope: Envelope) -> None:
        handled.append((time.time(), envelope.payload))

    bus.subscribe("work", send, group="limited", middleware=[RateLimit(rate)], concurrency=64)
    return bus


def _worker(kind: str, prefix: str, rate: float, seconds: float, out: Any) -> None:
    """One process: consume for ``seconds`` after its first handling, report times."""
    handled: list[tuple[float, int]] = []

    async def main() -> None:
        async with _bus(kind, prefix, rate, handled) as bus:
            while not handled:
                await anyio.sleep(0.01)
            await anyio.sleep(max(0.0, handled[0][0] + seconds - time.time()))
            await bus.aclose(0.5)

    anyio.run(main)
    out.put(handled)


async def _publish_backlog(kind: str, prefix: str, count: int) -> None:
    async with _bus(kind, prefix, 1.0, []):
        pass  # the group is made in the broker (nothing is published yet)
    async with Bus(transport=_transport(kind, prefix)) as bus:  # no consumer of its own
        for start in range(0, count, 1000):
            await bus.publish_many("work", list(range(start, min(count, start + 1000))))


async def _forget(kind: str, prefix: str) -> None:
    if kind == "redis":
        import redis.asyncio as redis

        client = redis.from_url(URLS["redis"])
        keys = [key async for key in client.scan_iter(f"{prefix}*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
    elif kind == "postgres":
        import asyncpg

        connection = await asyncpg.connect(URLS["postgres"])
        await connection.execute(f"DROP SCHEMA IF EXISTS {_schema(prefix)} CASCADE")
        await connection.close()
    else:
        import nats

        client = await nats.connect(URLS["nats"])
        js = client.jetstream()
        for stream in await js.streams_info():
            if stream.config.name and prefix.upper().replace("-", "_") in stream.config.name:
                await js.delete_stream(stream.config.name)
        await client.close()


def run(kind: str, rate: float, processes: int, seconds: float) -> dict[str, float]:
    prefix = f"asyncbus-bench-rate-{uuid.uuid4().hex[:8]}"
    backlog = int(rate * (seconds + WARM_UP + 5))
    anyio.run(_publish_backlog, kind, prefix, backlog)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    workers = [
        context.Process(target=_worker, args=(kind, prefix, rate, seconds + WARM_UP, out))
        for _ in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        handled = [item for _ in workers for item in out.get(timeout=seconds + 120)]
        for worker in workers:
            worker.join(30)
    finally:
        anyio.run(_forget, kind, prefix)
    times = sorted(at for at, _ in handled)
    begin = times[0] + WARM_UP
    end = begin + seconds - 1.0
    inside = sum(1 for at in times if begin <= at < end)
    counts: dict[int, int] = {}
    for _, payload in handled:
        counts[payload] = counts.get(payload, 0) + 1
    return {
        "rate": inside / (end - begin),
        "handled": len(handled),
        "duplicated": sum(1 for seen in counts.values() if seen > 1),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", default="redis", choices=sorted(URLS))
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--json")
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args(argv)
    result = run(options.transport, options.rate, options.processes, options.seconds)
    baseline = options.rate * options.processes
    off = result["rate"] / options.rate - 1
    print(
        f"RateLimit({options.rate:g}) shared by {options.processes} processes over "
        f"{options.transport}, {options.seconds:g} s measured"
    )
    print(f"{'':<26}{'per s':>10}{'x limit':>10}")
    print(
        f"{'group (shared limit)':<26}{result['rate']:>10.1f}{result['rate'] / options.rate:>10.3f}"
    )
    print(f"{'baseline (per process)':<26}{baseline:>10.1f}{baseline / options.rate:>10.3f}")
    print(f"handled {result['handled']:.0f}, duplicated {result['duplicated']:.0f}")
    met = abs(off) <= TOLERANCE and not result["duplicated"]
    print(
        f"target: within {TOLERANCE:.0%} of the limit, nothing handled twice: "
        + ("met" if met else f"MISSED ({off:+.1%})")
    )
    if options.json:
        with open(options.json, "w") as out:
            json.dump(result, out, indent=2)
    return 0 if met or not options.check else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
