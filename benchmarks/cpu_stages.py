"""CPU-bound stages: how thread and process offload scale with ``Bus(workers=N)``.

The reference workload: 24 envelopes, each 40,000 chained sha256 rounds
(``h = sha256(h).digest()``), through one stage with ``concurrency=workers``, at
workers 1, 2 and 4, for ``offload="thread"`` and ``offload="process"``. Every
configuration is run once to warm up (worker processes are started then, not in a
timed run) and then ``--repeats`` times, the repeats interleaved across
configurations so that a neighbour's load spreads over all of them; the table
reports medians. While the run goes on, a 1 ms ticker on the event loop measures
its lag (actual interval minus 1 ms), sampled only while every worker is busy.

Targets (judged with ``--check``, exit status 1 when one fails; without it, reported):

* process offload: at least 1.7x faster at 2 workers than at 1;
* thread offload: the same, on a free-threaded build only (on a GIL build the
  measured value is reported, not checked: one thread holds the GIL at a time);
* event-loop lag p99 under 5 ms while the pool is saturated: for process offload
  always, for thread offload on a free-threaded build (on a GIL build a busy worker
  thread keeps the GIL for up to ``sys.getswitchinterval()``, 5 ms by default, each
  time the loop thread asks for it; the lag is reported, and ``--switch-interval``
  shows how it follows that setting).

Run: ``python benchmarks/cpu_stages.py [--quick] [--check]``. It runs unchanged on
a free-threaded interpreter (3.13t, 3.14t) with asyncbus and anyio installed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio

import asyncbus
from asyncbus import Bus

# The worker function must be importable by name in a worker process: the child gets
# this process's sys.path, so this directory has to be on it however the script was
# started (``python benchmarks/cpu_stages.py`` puts it there already).
HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
_work = importlib.import_module("_work")

ENVELOPES = 24
WORKER_COUNTS = (1, 2, 4)
Offload = Literal["thread", "process"]
OFFLOADS: tuple[Offload, ...] = ("thread", "process")
TICK = 0.001
SPEEDUP_TARGET = 1.7
LAG_P99_TARGET = 0.005


@dataclass
class Measurements:
    """Every timed run of one (offload, workers) configuration."""

    walls: list[float] = field(default_factory=list)
    lags: list[float] = field(default_factory=list)

    @property
    def wall(self) -> float:
        return statistics.median(self.walls)


Results = dict[tuple[Offload, int], Measurements]


@dataclass(frozen=True)
class Settings:
    rounds: int
    repeats: int
    backend: str
    backend_options: dict[str, Any]


def quantile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank quantile; NaN when there are no samples."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


async def run_once(
    offload: Offload, workers: int, rounds: int
) -> tuple[float, list[float], list[str]]:
    """Push the workload through one stage once: wall time, loop lags, digests in order."""
    # The process-wide settings the bus leaves off by default: a short GIL switch
    # interval beside busy threads, worker processes that yield the CPU to the loop.
    bus = Bus(
        workers=workers,
        name=f"cpu-{offload}-{workers}",
        switch_interval=0.0005,
        worker_niceness=5,
    )
    digests: dict[int, str] = {}
    finished = 0

    async def collect(env: asyncbus.Envelope) -> None:
        nonlocal finished
        digests[int(env.headers["job"])] = env.payload
        finished += 1

    bus.subscribe("cpu", _work.chained_sha256, offload=offload, concurrency=workers)
    bus.subscribe("cpu.done", collect, concurrency=1)

    def saturated() -> bool:
        # More than `workers` envelopes still unfinished means a full pool: every
        # consumer holds one and the queue (or the next pick-up) has the rest.
        return ENVELOPES - finished > workers

    lags: list[float] = []

    async def tick() -> None:
        previous = time.perf_counter()
        was_saturated = saturated()
        while True:
            await anyio.sleep(TICK)
            now = time.perf_counter()
            is_saturated = saturated()
            if was_saturated and is_saturated:
                lags.append(max(0.0, now - previous - TICK))
            previous, was_saturated = now, is_saturated

    async with bus, anyio.create_task_group() as ticker:
        ticker.start_soon(tick)
        with anyio.fail_after(600):
            started = time.perf_counter()
            for index in range(ENVELOPES):
                seed = index.to_bytes(4, "big")
                await bus.publish(
                    "cpu", (seed, rounds), slip=["cpu.done"], headers={"job": str(index)}
                )
            await bus.drain()
            wall = time.perf_counter() - started
        ticker.cancel_scope.cancel()
        stats = bus.statistics()
        if (stats.acked, stats.dead_lettered) != (2 * ENVELOPES, 0):
            dead = [(d.reason.value, d.error) for d in bus.dead_letters.list()]
            raise RuntimeError(f"{offload}/{workers}: not every envelope was handled: {dead}")
    return wall, lags, [digests[index] for index in range(ENVELOPES)]


async def run_all(settings: Settings) -> Results:
    """Warm every configuration up once, then run them ``repeats`` times, interleaved."""
    # One event loop for everything: anyio keeps worker processes per event loop, so
    # the warm-up starts them and the timed runs reuse them.
    configurations = [(offload, workers) for offload in OFFLOADS for workers in WORKER_COUNTS]
    results = {configuration: Measurements() for configuration in configurations}
    reference: list[str] | None = None
    for offload, workers in configurations:
        _, _, digests = await run_once(offload, workers, settings.rounds)
        reference = reference or digests
        if digests != reference:
            raise RuntimeError(f"{offload}/{workers} computed different digests")
    for repeat in range(settings.repeats):
        for offload, workers in configurations:
            wall, lags, digests = await run_once(offload, workers, settings.rounds)
            if digests != reference:
                raise RuntimeError(f"{offload}/{workers} computed different digests")
            results[offload, workers].walls.append(wall)
            results[offload, workers].lags.extend(lags)
        print(f"  repeat {repeat + 1}/{settings.repeats} done", file=sys.stderr, flush=True)
    return results


def gil_state() -> str:
    probe = getattr(sys, "_is_gil_enabled", None)
    build = "free-threaded build" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL build"
    if probe is None:
        return f"on ({build}; sys._is_gil_enabled() not available)"
    return f"{'on' if probe() else 'off'} ({build}; sys._is_gil_enabled() = {probe()})"


def print_header(settings: Settings) -> None:
    loop = settings.backend + (" + uvloop" if settings.backend_options.get("use_uvloop") else "")
    print("asyncbus CPU stages benchmark")
    print(f"  interpreter : {platform.python_implementation()} {sys.version.splitlines()[0]}")
    print(f"  executable  : {sys.executable}")
    print(f"  GIL         : {gil_state()}; sys.getswitchinterval() = {sys.getswitchinterval()}")
    print(f"  FREE_THREADED = {asyncbus.FREE_THREADED}; os.cpu_count() = {os.cpu_count()}")
    print(f"  event loop  : {loop}; anyio {anyio_version()}")
    workload = "reference" if settings.rounds == _work.ROUNDS else "NOT the reference (--quick)"
    print(
        f"  workload    : {ENVELOPES} envelopes x {settings.rounds:,} chained sha256 rounds, "
        f"one stage, concurrency = workers ({workload})"
    )
    print(
        f"  method      : 1 warm-up + {settings.repeats} timed runs per configuration, "
        f"interleaved; medians reported; loop lag = 1 ms ticker interval - 1 ms, "
        f"sampled while the pool is saturated, pooled over the timed runs"
    )


def anyio_version() -> str:
    from importlib.metadata import version

    return version("anyio")


def print_table(results: Results) -> None:
    print()
    header = (
        f"{'offload':<8} {'workers':>7} {'median s':>9} {'min s':>7} {'max s':>7} "
        f"{'speedup':>8} {'lag p50 ms':>11} {'lag p99 ms':>11} {'lag n':>6}"
    )
    print(header)
    print("-" * len(header))
    for offload in OFFLOADS:
        base = results[offload, WORKER_COUNTS[0]].wall
        for workers in WORKER_COUNTS:
            m = results[offload, workers]
            print(
                f"{offload:<8} {workers:>7} {m.wall:>9.3f} {min(m.walls):>7.3f} "
                f"{max(m.walls):>7.3f} {base / m.wall:>7.2f}x "
                f"{quantile(m.lags, 0.50) * 1e3:>11.3f} {quantile(m.lags, 0.99) * 1e3:>11.3f} "
                f"{len(m.lags):>6}"
            )


def check(results: Results) -> bool:
    """Print PASS/FAIL per target (INFO for what is only reported); return whether all passed."""
    print()
    ok = True

    def verdict(passed: bool, text: str) -> None:
        nonlocal ok
        ok = ok and passed
        print(f"{'PASS' if passed else 'FAIL'}  {text}")

    for offload in OFFLOADS:
        speedup = results[offload, 1].wall / results[offload, 2].wall
        text = f"{offload} offload speedup at 2 workers over 1: {speedup:.2f}x"
        if offload == "process" or asyncbus.FREE_THREADED:
            verdict(speedup >= SPEEDUP_TARGET, f"{text} (target >= {SPEEDUP_TARGET}x)")
        else:
            print(f"INFO  {text} (reported, not a target: this build has the GIL)")
    for (offload, workers), m in results.items():
        p99 = quantile(m.lags, 0.99)
        text = f"loop lag p99 {offload}/{workers} workers: {p99 * 1e3:.3f} ms"
        if offload == "process" or asyncbus.FREE_THREADED:
            verdict(p99 < LAG_P99_TARGET, f"{text} (target < {LAG_P99_TARGET * 1e3:.0f} ms)")
        else:
            # A CPU-bound thread keeps the GIL until the loop thread has asked for it for
            # sys.getswitchinterval() (Bus(switch_interval=0.0005) lowers it while thread
            # stages run), and each further busy thread can win the hand-over again.
            print(
                f"INFO  {text} (reported, not a target on a GIL build: busy threads keep "
                f"the GIL for the switch interval at a time)"
            )
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a quarter of the rounds, 3 repeats (a smoke run)"
    )
    parser.add_argument("--repeats", type=int, help="timed runs per configuration (>= 3)")
    parser.add_argument(
        "--check", action="store_true", help="judge the targets; exit 1 when one fails"
    )
    parser.add_argument(
        "--backend",
        choices=("default", "asyncio", "uvloop", "trio"),
        default="default",
        help="event loop; default: what asyncbus.run uses (uvloop when installed)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        metavar="SECONDS",
        help="set sys.setswitchinterval() first (GIL builds: how long a thread keeps the GIL)",
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 5)
    if repeats < 3:
        parser.error("--repeats must be at least 3")
    backend, options = args.backend, {}
    if backend == "default":
        try:
            importlib.import_module("uvloop")
        except ImportError:
            backend = "asyncio"
        else:
            backend = "uvloop"
    if backend == "uvloop":
        backend, options = "asyncio", {"use_uvloop": True}
    settings = Settings(
        rounds=_work.ROUNDS // 4 if args.quick else _work.ROUNDS,
        repeats=repeats,
        backend=backend,
        backend_options=options,
    )
    print_header(settings)
    if args.backend == "default":
        results = asyncbus.run(run_all, settings)
    else:
        results = anyio.run(run_all, settings, backend=backend, backend_options=options)
    print_table(results)
    if not args.check:
        return 0
    return 0 if check(results) else 1


if __name__ == "__main__":
    sys.exit(main())
