"""Partitions over a broker: what order per key across replicas costs.

``python benchmarks/partitions.py [--transport redis|nats|rabbit|postgres]
[--messages 4000] [--keys 200] [--partitions 4] [--replicas 2] [--rounds 3]
[--json PATH] [--check]``

Each round runs ``replicas`` buses in this process (each its own connection, as
replicas would be) on one group, and times from the first publish until every envelope
was handled, for two groups in turn (the same round, alternating, so a stall of a
shared machine hits them alike):

* ``unordered``: the group without ordering (competing consumers), the baseline;
* ``partitioned``: ``ordering="key"`` with ``partitions`` partitions, which the
  replicas share (the broker stores and delivers each envelope once per partition, and
  each partition's consumer acks the others' at once).

It prints envelopes per second (the median over the rounds) and the partitioned group's
ratio to the unordered one. Target: at least :data:`TARGET` of the unordered group's
throughput with 4 partitions and 2 replicas (``--check`` exits 1 below it, or when an
envelope is lost, handled twice or out of its key's order, or when a key was handled
by two replicas).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from contextlib import AsyncExitStack
from typing import Any

import anyio
import rate_limit  # beside this script: its transports and clean-up

from asyncbus import HEADER_KEY, Bus, Envelope

#: The partitioned group's least throughput, as a share of the unordered group's: with 4
#: partitions the broker stores and delivers each envelope 4 times, which this bounds.
TARGET = 0.4
URLS = {**rate_limit.URLS, "rabbit": "amqp://guest:guest@127.0.0.1:5672/"}


def _transport(kind: str, prefix: str) -> Any:
    if kind == "rabbit":
        from asyncbus.transports.rabbit import RabbitTransport

        return RabbitTransport(URLS[kind], prefix=prefix)
    return rate_limit._transport(kind, prefix)


async def _forget(kind: str, prefix: str) -> None:
    """Remove what the round left in the broker."""
    if kind != "rabbit":
        await rate_limit._forget(kind, prefix)
        return
    transport = _transport(kind, prefix)
    async with transport:
        await transport.delete_everything()


async def group_round(options: argparse.Namespace, partitions: int | None) -> dict[str, Any]:
    """One group of ``replicas`` buses; ``partitions=None``: unordered."""
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    handled: dict[str, list[int]] = {}
    by: dict[str, set[int]] = {}
    count = 0
    done = anyio.Event()
    buses = []
    for replica in range(options.replicas):
        bus = Bus(transport=_transport(options.transport, prefix), name=f"replica-{replica}")

        def handler(replica: int) -> Any:
            async def handle(envelope: Envelope) -> None:
                nonlocal count
                key = envelope.headers[HEADER_KEY]
                handled.setdefault(key, []).append(envelope.payload)
                by.setdefault(key, set()).add(replica)
                count += 1
                if count >= options.messages:
                    done.set()

            return handle

        ordering = None if partitions is None else "key"
        bus.subscribe(
            "bench",
            handler(replica),
            group="g",
            concurrency=16,
            ordering=ordering,  # type: ignore[arg-type]
            partitions=partitions,
        )
        buses.append(bus)
    names = [f"k{k}" for k in range(options.keys)]
    try:
        async with AsyncExitStack() as stack:
            for bus in buses:
                await stack.enter_async_context(bus)
            if partitions is not None:  # balanced before the clock starts
                share = partitions // len(buses)
                while any(
                    b.statistics().stage("bench@g").partitions_owned < share for b in buses
                ) or sum(b.statistics().stage("bench@g").partitions_owned for b in buses) < (
                    partitions
                ):
                    await anyio.sleep(0.05)
            publisher = buses[0]
            began = time.perf_counter()
            step = options.keys * 4  # a batch per key, each key's payloads in order
            for start in range(0, options.messages, step):
                chunk = range(start, min(start + step, options.messages))
                for k, name in enumerate(names):
                    mine = [n for n in chunk if n % options.keys == k]
                    if mine:
                        await publisher.publish_many("bench", mine, key=name)
            with anyio.fail_after(300):
                await done.wait()
            seconds = time.perf_counter() - began
    finally:
        await _forget(options.transport, prefix)
    disorder = sum(1 for ns in handled.values() if ns != sorted(ns))
    return {
        "rate": options.messages / seconds,
        "lost": options.messages - len({n for ns in handled.values() for n in ns}),
        "twice": count - len({n for ns in handled.values() for n in ns}),
        "disorder": disorder if partitions is not None else 0,
        "shared_keys": sum(1 for r in by.values() if len(r) > 1) if partitions else 0,
    }


async def run(options: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {"unordered": [], "partitioned": []}
    for _ in range(options.rounds):
        rounds["unordered"].append(await group_round(options, None))
        rounds["partitioned"].append(await group_round(options, options.partitions))
    result: dict[str, Any] = {}
    for name, results in rounds.items():
        ratios = [
            r["rate"] / base["rate"] for r, base in zip(results, rounds["unordered"], strict=True)
        ]
        result[name] = {
            "rate": statistics.median(r["rate"] for r in results),
            "ratio_to_unordered": statistics.median(ratios),
            "ratios": [round(ratio, 3) for ratio in ratios],
            **{key: max(r[key] for r in results) for key in ("lost", "twice", "disorder")},
            "shared_keys": max(r["shared_keys"] for r in results),
        }
    return result


def verdict(result: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether the target is met, and why not."""
    failures = []
    ratio = result["partitioned"]["ratio_to_unordered"]
    if ratio < TARGET:
        failures.append(f"partitioned keeps {ratio:.2f}x the unordered throughput (< {TARGET})")
    for name, figures in result.items():
        for key in ("lost", "twice", "disorder"):
            if figures[key]:
                failures.append(f"{name}: {figures[key]} {key}")
    if result["partitioned"]["shared_keys"]:
        failures.append(f"{result['partitioned']['shared_keys']} keys ran on two replicas")
    return not failures, failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transport", choices=tuple(URLS), default="redis")
    parser.add_argument("--messages", type=int, default=4_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    options = parser.parse_args(argv)
    result = anyio.run(run, options)
    print(
        f"{options.transport}: {options.messages} envelopes, {options.keys} keys, "
        f"{options.replicas} replicas, {options.partitions} partitions "
        f"(median of {options.rounds} rounds)"
    )
    for name, figures in result.items():
        print(
            f"  {name:<12} {figures['rate']:>9,.0f}/s  {figures['ratio_to_unordered']:.2f}x "
            f"unordered (rounds {figures['ratios']})"
        )
    ok, failures = verdict(result)
    print(f"target: partitioned >= {TARGET}x unordered: {'met' if ok else 'MISSED'}")
    for failure in failures:
        print(f"  {failure}")
    if options.json:
        with open(options.json, "w") as out:
            json.dump(result, out, indent=2)
    return 1 if options.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
