"""Order per key in memory: what ``ordering="key"`` costs next to an unordered stage.

``python benchmarks/ordering.py [--messages 20000] [--keys 1000] [--concurrency 16]
[--work 0] [--rounds 5] [--loop asyncio|uvloop|trio] [--json PATH] [--check]``

Each round publishes ``messages`` envelopes (``key=`` one of ``keys``, round robin) to
a stage with ``concurrency`` consumers whose async handler yields once (or, with
``--work S``, sleeps ``S`` seconds: a handler waiting on I/O, where running many keys at
once is what keeps the throughput), and times from
the first publish to the drain, on four stages in turn (the same round, alternating, so
a stall of a shared machine hits them alike):

* ``raw``: the floor, a bounded anyio memory stream with ``concurrency`` receivers;
* ``unordered``: the stage without ordering, given the same keyed publishes (the
  baseline the target is judged on);
* ``ordered``: ``ordering="key"`` with ``keys`` distinct keys;
* ``hot key``: ``ordering="key"`` with every envelope on one key; its handlers must run
  one at a time (the most running at once is printed and checked: 1).

It prints envelopes per second (the median over the rounds) and each stage's ratio to
``unordered``, round by round. Target: ``ordered`` keeps at least 0.8x the unordered
stage's throughput (the median of the per-round ratios); ``--check`` exits 1 when it
does not, or when an envelope is lost, handled twice, out of order, or when the hot key
ran two at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from asyncbus import Bus, Envelope

TARGET = 0.8


async def pause(work: float) -> None:
    """The handler's work: one yield, or ``work`` seconds of waiting."""
    if work:
        await anyio.sleep(work)
    else:
        await anyio.lowlevel.checkpoint()


async def raw_round(messages: int, concurrency: int, work: float) -> dict[str, Any]:
    """The floor: ``concurrency`` receivers on one bounded memory stream."""
    send, receive = anyio.create_memory_object_stream[int](1024)
    handled = 0

    async def receiver(mine: anyio.abc.ObjectReceiveStream[int]) -> None:
        nonlocal handled
        async with mine:
            async for _ in mine:
                await pause(work)
                handled += 1

    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        with receive:
            for _ in range(concurrency):
                group.start_soon(receiver, receive.clone())
        async with send:
            for n in range(messages):
                await send.send(n)
    seconds = time.perf_counter() - began
    return {"rate": messages / seconds, "lost": messages - handled, "disorder": 0, "most": 0}


async def bus_round(
    messages: int, concurrency: int, work: float, keys: int, ordering: str | None
) -> dict[str, Any]:
    """One stage of the bus, its envelopes published with ``keys`` keys in turn."""
    bus = Bus()
    last: dict[str, int] = {}
    disorder = handled = running = most = 0

    @bus.subscribe("bench", group="g", concurrency=concurrency, ordering=ordering)  # type: ignore[arg-type]
    async def handle(envelope: Envelope) -> None:
        nonlocal disorder, handled, running, most
        running += 1
        most = max(most, running)
        key = envelope.headers["asyncbus-key"]
        await pause(work)
        if ordering is not None and envelope.payload <= last.get(key, -1):
            disorder += 1
        last[key] = envelope.payload
        handled += 1
        running -= 1

    names = [str(k) for k in range(keys)]
    async with bus:
        began = time.perf_counter()
        for n in range(messages):
            await bus.publish("bench", n, key=names[n % keys])
        await bus.drain()
        seconds = time.perf_counter() - began
    return {
        "rate": messages / seconds,
        "lost": messages - handled,
        "disorder": disorder,
        "most": most,
    }


STAGES = ("raw", "unordered", "ordered", "hot key")


async def run(options: argparse.Namespace) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in STAGES}
    shape = (options.messages, options.concurrency, options.work)
    for _ in range(options.rounds):
        rounds["raw"].append(await raw_round(*shape))
        rounds["unordered"].append(await bus_round(*shape, options.keys, None))
        rounds["ordered"].append(await bus_round(*shape, options.keys, "key"))
        rounds["hot key"].append(await bus_round(*shape, 1, "key"))
    result: dict[str, Any] = {}
    for name, results in rounds.items():
        ratios = [
            r["rate"] / base["rate"] for r, base in zip(results, rounds["unordered"], strict=True)
        ]
        result[name] = {
            "rate": statistics.median(r["rate"] for r in results),
            "ratio_to_unordered": statistics.median(ratios),
            "lost": max(r["lost"] for r in results),
            "disorder": max(r["disorder"] for r in results),
            "most_at_once": max(r["most"] for r in results),
        }
    return result


def verdict(result: dict[str, Any], concurrency: int) -> tuple[bool, list[str]]:
    """Whether the target is met, and why not."""
    failures = []
    ratio = result["ordered"]["ratio_to_unordered"]
    if ratio < TARGET:
        failures.append(f"ordered keeps {ratio:.2f}x the unordered throughput (< {TARGET})")
    for name in STAGES:
        if result[name]["lost"] or result[name]["disorder"]:
            failures.append(
                f"{name}: {result[name]['lost']} lost, {result[name]['disorder']} out of order"
            )
    if result["hot key"]["most_at_once"] != 1:
        failures.append(f"the hot key ran {result['hot key']['most_at_once']} at once")
    if result["ordered"]["most_at_once"] < min(concurrency, 2):
        failures.append("the ordered stage never ran two keys at once")
    return not failures, failures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--work", type=float, default=0.0, help="seconds each handler waits")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    options = parser.parse_args(argv)
    backend = "trio" if options.loop == "trio" else "asyncio"
    backend_options = {"use_uvloop": True} if options.loop == "uvloop" else {}
    result = anyio.run(run, options, backend=backend, backend_options=backend_options)
    print(
        f"ordering, {options.messages:,} envelopes, {options.keys:,} keys, concurrency "
        f"{options.concurrency}, work {options.work * 1000:g} ms, {options.loop}, "
        f"median of {options.rounds} rounds"
    )
    print(f"{'stage':<12}{'envelopes/s':>14}{'x unordered':>13}{'most at once':>14}")
    for name, row in result.items():
        most = "-" if name == "raw" else str(row["most_at_once"])  # (not counted there)
        print(f"{name:<12}{row['rate']:>14,.0f}{row['ratio_to_unordered']:>13.2f}{most:>14}")
    met, failures = verdict(result, options.concurrency)
    print(
        f"target: ordered >= {TARGET}x unordered, nothing lost or out of order, the hot key "
        "one at a time: " + ("met" if met else "MISSED: " + "; ".join(failures))
    )
    if options.json:
        with open(options.json, "w") as file:
            json.dump(result, file, indent=2)
    return 1 if options.check and not met else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
