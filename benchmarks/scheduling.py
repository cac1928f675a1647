"""Scheduled publishes: how late a delayed envelope arrives, per transport.

``python benchmarks/scheduling.py [--transports memory,redis,nats,rabbit] [--rate 1000]
[--seconds 3] [--delay 10] [--rounds 3] [--json PATH] [--check]``

Each round publishes ``rate`` envelopes a second for ``seconds`` seconds, each with
``delay=`` (over a broker a delay above four seconds goes back to the broker once, with
its delayed redelivery, before it is held in hand), and measures each one's lateness:
when its handler got it (wall clock) minus its receipt's ``scheduled``. The baseline in
the same run is the floor of any timer on this event loop: one task per envelope that
sleeps until the same instant (``anyio.sleep``) and measures its own lateness. It
prints p50/p99/max lateness per transport (the median over the rounds), the rate the
publisher achieved, the envelopes lost or duplicated (must be none) and the ratio of
p99 to the baseline's. Target: p99 lateness at most 100 ms at 1,000 scheduled per
second (``--check`` exits 1 when a transport misses it or loses anything).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from typing import Any

import anyio

from asyncbus import Bus, Envelope

TARGET_P99 = 0.100
URLS = {
    "redis": "redis://127.0.0.1:6379/0",
    "nats": "nats://127.0.0.1:4222",
    "rabbit": "amqp://guest:guest@127.0.0.1:5672/",
}


def transport(kind: str, prefix: str) -> Any:
    if kind == "memory":
        return None
    if kind == "redis":
        from asyncbus.transports.redis import RedisTransport

        return RedisTransport(URLS[kind], prefix=prefix)
    if kind == "nats":
        from asyncbus.transports.nats import NatsTransport

        return NatsTransport(URLS[kind], prefix=prefix)
    from asyncbus.transports.rabbit import RabbitTransport

    return RabbitTransport(URLS[kind], prefix=prefix)


async def forget(kind: str, prefix: str) -> None:
    """Remove what a round left in the broker (best effort)."""
    if kind == "redis":
        import redis.asyncio as redis

        client = redis.Redis.from_url(URLS[kind])
        async for key in client.scan_iter(f"{prefix}*"):
            await client.delete(key)
        await client.aclose()
    elif kind == "nats":
        import nats

        nc = await nats.connect(URLS[kind])
        js = nc.jetstream()
        for info in await js.streams_info():
            if info.config.name and prefix.upper() in info.config.name.upper():
                await js.delete_stream(info.config.name)
        await nc.close()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def paced(rate: float, count: int, send: Any) -> float:
    """Start ``send(i)`` ``count`` times at ``rate`` a second (open loop: a slow call
    does not hold the next back); the rate the calls completed at."""
    began = time.perf_counter()
    async with anyio.create_task_group() as calls:
        for i in range(count):
            wait = began + i / rate - time.perf_counter()
            if wait > 0:
                await anyio.sleep(wait)
            calls.start_soon(send, i)
        started = time.perf_counter()
    return count / max(started - began, 1e-9)


async def baseline_round(rate: float, seconds: float, delay: float) -> dict[str, Any]:
    """The floor: a task per envelope sleeping until its instant on this loop."""
    lateness: list[float] = []
    count = int(rate * seconds)

    async def sleeper(due: float) -> None:
        await anyio.sleep(max(due - time.time(), 0))
        lateness.append(time.time() - due)

    async def send(_: int) -> None:
        await sleeper(time.time() + delay)

    achieved = await paced(rate, count, send)
    return {"lateness": lateness, "rate": achieved, "lost": 0, "duplicated": 0}


async def bus_round(
    kind: str, rate: float, seconds: float, delay: float, now: bool = False
) -> dict[str, Any]:
    """One round over ``kind``; ``now``: plain publishes (the transport's own latency,
    from the publish to the handler, at the same rate: the floor of the scheduled)."""
    prefix = f"bsched{uuid.uuid4().hex[:8]}"
    count = int(rate * seconds)
    arrived: dict[str, float] = {}
    duplicated = 0
    done = anyio.Event()

    async def handle(envelope: Envelope) -> None:
        nonlocal duplicated
        if envelope.id in arrived:
            duplicated += 1
        arrived[envelope.id] = time.time()
        if len(arrived) == count:
            done.set()

    bus = Bus(transport(kind, prefix))
    bus.subscribe("bench.scheduled", handle, group="bench", concurrency=16, capacity=4096)
    due: dict[str, float] = {}
    try:
        async with bus:

            async def send(_: int) -> None:
                if now:
                    sent = time.time()
                    receipt = await bus.publish("bench.scheduled", None)
                    due[receipt.id] = sent
                    return
                receipt = await bus.publish("bench.scheduled", None, delay=delay)
                assert receipt.scheduled is not None
                due[receipt.id] = receipt.scheduled.timestamp()

            achieved = await paced(rate, count, send)
            with anyio.move_on_after(delay + 30):
                await done.wait()
    finally:
        with anyio.CancelScope(shield=True):
            await forget(kind, prefix)
    lateness = [arrived[i] - due[i] for i in due if i in arrived]
    return {
        "lateness": lateness,
        "rate": achieved,
        "lost": count - len(arrived),
        "duplicated": duplicated,
    }


def summary(rounds: list[dict[str, Any]]) -> dict[str, float]:
    def median_of(figure: Any) -> float:
        return statistics.median(figure(r) for r in rounds)

    return {
        "p50": median_of(lambda r: quantile(r["lateness"], 0.50) if r["lateness"] else 0.0),
        "p99": median_of(lambda r: quantile(r["lateness"], 0.99) if r["lateness"] else 0.0),
        "max": median_of(lambda r: max(r["lateness"]) if r["lateness"] else 0.0),
        "rate": median_of(lambda r: r["rate"]),
        "lost": max(r["lost"] for r in rounds),
        "duplicated": max(r["duplicated"] for r in rounds),
    }


async def run(options: argparse.Namespace) -> dict[str, dict[str, float]]:
    transports = options.transports.split(",")
    kinds = ["baseline"]
    for kind in transports:
        kinds += [kind] if kind == "memory" else [f"{kind} now", kind]
    rounds: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for _ in range(options.rounds):
        for kind in kinds:  # alternate, (a stall of a shared machine hits all alike)
            if kind == "baseline":
                result = await baseline_round(options.rate, options.seconds, options.delay)
            else:
                name, _, now = kind.partition(" ")
                result = await bus_round(
                    name, options.rate, options.seconds, options.delay, bool(now)
                )
            rounds[kind].append(result)
    return {kind: summary(results) for kind, results in rounds.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="memory,redis,nats,rabbit")
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--delay", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args(argv)
    results = anyio.run(run, options)
    floor = results["baseline"]["p99"]
    print(
        f"scheduled publishes: {options.rate:g}/s for {options.seconds:g} s, delay "
        f"{options.delay:g} s, median of {options.rounds} rounds (lateness in ms)"
    )
    print(
        f"{'transport':<12}{'p50':>8}{'p99':>8}{'max':>8}{'rate/s':>9}{'lost':>6}{'dup':>5}"
        f"{'p99 x floor':>13}"
    )
    failed = []
    for kind, figures in results.items():
        ratio = figures["p99"] / floor if floor > 0 else float("inf")
        print(
            f"{kind:<12}{figures['p50'] * 1000:>8.1f}{figures['p99'] * 1000:>8.1f}"
            f"{figures['max'] * 1000:>8.1f}{figures['rate']:>9.0f}{figures['lost']:>6.0f}"
            f"{figures['duplicated']:>5.0f}{ratio:>13.1f}"
        )
        if (
            kind != "baseline"
            and not kind.endswith(" now")
            and (figures["p99"] > TARGET_P99 or figures["lost"] or figures["duplicated"])
        ):
            failed.append(kind)
    print(
        f"target: p99 <= {TARGET_P99 * 1000:.0f} ms, nothing lost or duplicated: "
        + ("met" if not failed else f"MISSED by {', '.join(failed)}")
    )
    if options.json:
        with open(options.json, "w") as out:
            json.dump(results, out, indent=2)
    return 1 if failed and options.check else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
