"""Memory: resident growth per queued envelope, flatness under load, envelope overhead.

Runs in a fresh interpreter (``python -m suite._memory``, ``benchmarks/`` on the path), so
that memory freed by earlier benchmarks cannot be reused and hide growth.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio

from asyncbus import Bus, Envelope

from ._model import Payload, Tally, make_messages, settle

__all__ = ["MemoryReport", "measure_memory"]

TOPIC = "bench.memory"


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """What the memory run found (sizes in bytes)."""

    loop: str
    rss_source: str
    capacity: int
    rss_empty: int
    rss_full: int
    #: Resident growth from an empty stage to a full one, per queued envelope.
    rss_per_envelope: float
    sustained_messages: int
    #: Resident size sampled while publishers kept the full stage full.
    rss_sustained: tuple[int, ...]
    depth_sustained: tuple[int, ...]
    rss_after_sustained: int
    #: Growth while the queue stayed full (rss_after_sustained - rss_full).
    drift: int
    flat: bool
    traced_envelopes: int
    #: tracemalloc growth per queued envelope, payloads built before (so not counted).
    overhead_per_envelope: float
    #: The same measure for a raw anyio stream holding the same payloads.
    raw_overhead_per_item: float
    #: ``sys.getsizeof`` of one Envelope plus its id string (the rest is the stage's).
    envelope_object: int


def rss() -> tuple[int, str]:
    """Resident set size in bytes, and where it was read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"), "/proc/self/statm"
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (peak if sys.platform == "darwin" else peak * 1024), "getrusage peak"


def _gated_bus(capacity: int, gate: anyio.Event, tally: Tally) -> Bus:
    async def handle(payload: Payload) -> None:
        if not gate.is_set():
            await gate.wait()
        tally.n += 1

    bus = Bus()
    bus.subscribe(TOPIC, handle, capacity=capacity)
    return bus


async def _rss_run(capacity: int, sustained: int) -> dict[str, Any]:
    payloads = make_messages(capacity)
    gate = anyio.Event()
    tally = Tally()
    bus = _gated_bus(capacity, gate, tally)
    async with bus:
        await settle()
        await bus.publish(TOPIC, payloads[0])  # taken by the consumer, held at the gate
        await settle()
        gc.collect()
        empty, source = rss()
        for payload in payloads:
            await bus.publish(TOPIC, payload)
        gc.collect()
        full, _ = rss()
        samples: list[int] = []
        depths: list[int] = []
        every = max(1, sustained // 20)

        async def publisher(count: int, sample: bool) -> None:
            for index in range(count):
                await bus.publish(TOPIC, payloads[index % capacity])
                if sample and index % every == every - 1:
                    samples.append(rss()[0])
                    depths.append(bus.statistics().stages[0].depth)

        gate.set()
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher, sustained // 2, True)
            tg.start_soon(publisher, sustained - sustained // 2, False)
        gc.collect()
        after, _ = rss()
        await bus.drain()
    fill = full - empty
    drift = after - full
    return {
        "rss_source": source,
        "rss_empty": empty,
        "rss_full": full,
        "rss_per_envelope": fill / capacity,
        "rss_sustained": tuple(samples),
        "depth_sustained": tuple(depths),
        "rss_after_sustained": after,
        "drift": drift,
        # Flat: what the full queue holds steady does not grow by more than a few
        # per cent of the fill (or one MiB, below which RSS pages are noise).
        "flat": drift <= max(1 << 20, fill // 20) and min(depths, default=0) >= capacity * 0.9,
    }


async def _traced_run(count: int) -> dict[str, Any]:
    payloads = make_messages(count + 1)
    gate = anyio.Event()
    tally = Tally()
    bus = _gated_bus(count, gate, tally)
    async with bus:
        await settle()
        await bus.publish(TOPIC, payloads[0])
        await settle()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for payload in payloads[1:]:
                await bus.publish(TOPIC, payload)
            gc.collect()
            ours = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        gate.set()
        await bus.drain()

    send, receive = anyio.create_memory_object_stream[Payload](count)
    with send, receive:
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for payload in payloads[1:]:
                send.send_nowait(payload)
            raw = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
    sample = Envelope(topic=TOPIC, payload=payloads[0])
    return {
        "overhead_per_envelope": ours / count,
        "raw_overhead_per_item": raw / count,
        "envelope_object": sys.getsizeof(sample) + sys.getsizeof(sample.id),
    }


def _run_here(loop: str, capacity: int, sustained: int, traced: int) -> MemoryReport:
    from ._runner import run_on

    async def both() -> dict[str, Any]:
        found = await _rss_run(capacity, sustained)
        found.update(await _traced_run(traced))
        return found

    found: dict[str, Any] = run_on(loop, both)
    return MemoryReport(
        loop=loop,
        capacity=capacity,
        sustained_messages=sustained,
        traced_envelopes=traced,
        **found,
    )


def measure_memory(loop: str, capacity: int, sustained: int, traced: int) -> MemoryReport:
    """Run the memory measurements in a fresh interpreter and return what they found."""
    command = [
        sys.executable,
        "-m",
        f"{__package__}._memory",
        f"--loop={loop}",
        f"--capacity={capacity}",
        f"--sustained={sustained}",
        f"--traced={traced}",
    ]
    # The child imports this package by name: the directory that holds it goes on its path.
    path = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, timeout=900, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory run failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    found = json.loads(done.stdout)
    found["rss_sustained"] = tuple(found["rss_sustained"])
    found["depth_sustained"] = tuple(found["depth_sustained"])
    return MemoryReport(**found)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m suite._memory")
    parser.add_argument("--loop", default="asyncio")
    parser.add_argument("--capacity", type=int, default=50_000)
    parser.add_argument("--sustained", type=int, default=150_000)
    parser.add_argument("--traced", type=int, default=20_000)
    options = parser.parse_args(argv)
    report = _run_here(options.loop, options.capacity, options.sustained, options.traced)
    json.dump(asdict(report), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
