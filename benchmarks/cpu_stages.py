"""CPU-bound stages: how thread and process offload scale with ``Bus(workers=N)``.

The reference workload: 24 envelopes, each 150,000 steps of a small linear congruential
generator in plain Python (``_work.crunch``; why not a hash loop: its docstring),
through one stage with ``concurrency=workers``, at
workers 1, 2 and 4 (and 8, 16 where the machine has that many cores), for
``offload="thread"`` and ``offload="process"``. Every
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

**Across interpreters** (``--scaling``): the same workload on this machine's GIL build
with ``offload="thread"`` and ``offload="process"`` and on a free-threaded build with
``offload="thread"``, at 1 and 2 workers (more where the machine has the cores), each
against the same work done serially (a plain loop, no bus) on the same interpreter:

    python benchmarks/cpu_stages.py --scaling --free-threaded .ci-ft/bin/python --check
    python -m asyncbus bench cpu --scaling --free-threaded .ci-ft/bin/python --check

``--free-threaded`` is a 3.13t/3.14t interpreter with asyncbus and anyio installed (CI
makes ``.ci-ft`` from what ``.ci/python-ft`` builds); ``--gil`` the GIL build (default:
the interpreter running this, when it has the GIL). Each interpreter is measured in a
process of its own, one after the other. The table gives each configuration's speedup
over serial and the bus's overhead per message: the time per envelope of a handler
that does nothing, through one stage on one worker (publish, queue, the hop to the
pool and back, ack). Targets (``--check``; exit status 1 when one fails):

* threads on the free-threaded build: at least 1.8x faster than serial at 2 workers;
* thread offload's overhead per message on the free-threaded build: at most 1.5x the
  GIL build's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
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
#: 1, 2 and 4 workers, and more where the machine has the cores.
WORKER_COUNTS = tuple(n for n in (1, 2, 4, 8, 16) if n <= max(4, os.cpu_count() or 1))
Offload = Literal["thread", "process"]
OFFLOADS: tuple[Offload, ...] = ("thread", "process")
TICK = 0.001
SPEEDUP_TARGET = 1.7
LAG_P99_TARGET = 0.005
#: --scaling: threads on a free-threaded build at 2 workers, against serial.
FREE_THREADED_SPEEDUP_TARGET = 1.8
#: --scaling: the free-threaded build's thread overhead per message over the GIL build's.
OVERHEAD_RATIO_TARGET = 1.5
#: --scaling: envelopes of the do-nothing handler that measures the overhead.
OVERHEAD_ENVELOPES = 2_000


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

    bus.subscribe("cpu", _work.crunch, offload=offload, concurrency=workers)
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
        f"  workload    : {ENVELOPES} envelopes x {settings.rounds:,} steps of plain Python, "
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


class Verdicts:
    """Prints one PASS or FAIL line per target; ``ok`` until one fails."""

    def __init__(self) -> None:
        print()
        self.ok = True

    def __call__(self, passed: bool, text: str) -> None:
        self.ok = self.ok and passed
        print(f"{'PASS' if passed else 'FAIL'}  {text}")


def check(results: Results) -> bool:
    """Print PASS/FAIL per target (INFO for what is only reported); return whether all passed."""
    verdict = Verdicts()
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
    return verdict.ok


# -- across interpreters (--scaling) ----------------------------------------------------


def scaling_worker_counts() -> tuple[int, ...]:
    """1 and 2 workers, and more where the machine has the cores."""
    return tuple(n for n in (1, 2, 4, 8, 16) if n <= max(2, os.cpu_count() or 1))


def serial_once(rounds: int) -> tuple[float, list[str]]:
    """The workload as a plain loop on this thread, no bus: wall time and digests."""
    started = time.perf_counter()
    digests = [_work.crunch((index.to_bytes(4, "big"), rounds)) for index in range(ENVELOPES)]
    return time.perf_counter() - started, digests


async def overhead_once(offload: Offload) -> float:
    """Seconds per envelope of a handler that does nothing, one stage, one worker."""
    bus = Bus(workers=1, name=f"overhead-{offload}")
    bus.subscribe("noop", _work.nothing, offload=offload, group="noop")
    async with bus:
        with anyio.fail_after(600):
            started = time.perf_counter()
            for index in range(OVERHEAD_ENVELOPES):
                await bus.publish("noop", index)
            await bus.drain()
            elapsed = time.perf_counter() - started
        acked = bus.statistics().acked
    if acked != OVERHEAD_ENVELOPES:
        raise RuntimeError(f"overhead/{offload}: {acked} of {OVERHEAD_ENVELOPES} acked")
    return elapsed / OVERHEAD_ENVELOPES


async def measure(settings: Settings, offloads: Sequence[Offload]) -> dict[str, Any]:
    """Every configuration of ``--scaling`` on this interpreter, as JSON-able medians.

    Serial, then each offload at each worker count, then each offload's overhead per
    message: one warm-up each, then ``repeats`` rounds interleaved.
    """
    counts = scaling_worker_counts()
    configurations = [(offload, workers) for offload in offloads for workers in counts]
    walls: dict[str, list[float]] = {"serial": []}
    walls.update({f"{offload}/{workers}": [] for offload, workers in configurations})
    overheads: dict[str, list[float]] = {offload: [] for offload in offloads}
    _, reference = serial_once(settings.rounds)

    async def one_round(record: bool) -> None:
        wall, digests = serial_once(settings.rounds)
        if record:
            walls["serial"].append(wall)
        for offload, workers in configurations:
            wall, _, digests = await run_once(offload, workers, settings.rounds)
            if digests != reference:
                raise RuntimeError(f"{offload}/{workers} computed different digests")
            if record:
                walls[f"{offload}/{workers}"].append(wall)
        for offload in offloads:
            seconds = await overhead_once(offload)
            if record:
                overheads[offload].append(seconds)

    await one_round(record=False)
    for repeat in range(settings.repeats):
        await one_round(record=True)
        print(f"  repeat {repeat + 1}/{settings.repeats} done", file=sys.stderr, flush=True)
    return {
        "version": sys.version.split()[0],
        "executable": sys.executable,
        "free_threaded": asyncbus.FREE_THREADED,
        "gil": gil_state(),
        "cpu_count": os.cpu_count(),
        "loop": settings.backend + (" + uvloop" if settings.backend_options else ""),
        "rounds": settings.rounds,
        "repeats": settings.repeats,
        "walls": {name: statistics.median(values) for name, values in walls.items()},
        "overhead_us": {
            offload: statistics.median(values) * 1e6 for offload, values in overheads.items()
        },
    }


def measure_in(python: str, offloads: Sequence[Offload], args: argparse.Namespace) -> Any:
    """:func:`measure` in a process of ``python`` (its progress on stderr); its JSON."""
    command = [
        python,
        os.path.abspath(__file__),
        "--measure",
        ",".join(offloads),
        "--repeats",
        str(args.repeats),
        "--backend",
        args.backend,
    ]
    if args.quick:
        command.append("--quick")
    print(f"+ {' '.join(command)}", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measuring on {python} failed (exit status {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_scaling(results: list[tuple[str, Offload, Any]]) -> None:
    """One row per (interpreter, offload, workers), after each interpreter's serial row."""
    header = (
        f"{'interpreter':<32} {'offload':<8} {'workers':>7} {'median s':>9} "
        f"{'vs serial':>10} {'overhead µs/msg':>16}"
    )
    print()
    print(header)
    print("-" * len(header))
    shown: set[str] = set()
    for label, offload, found in results:
        serial = found["walls"]["serial"]
        if label not in shown:
            shown.add(label)
            print(f"{label:<32} {'serial':<8} {1:>7} {serial:>9.3f} {1:>9.2f}x {'-':>16}")
        for workers in scaling_worker_counts():
            wall = found["walls"][f"{offload}/{workers}"]
            print(
                f"{label:<32} {offload:<8} {workers:>7} {wall:>9.3f} "
                f"{serial / wall:>9.2f}x {found['overhead_us'][offload]:>16.1f}"
            )


def check_scaling(gil: Any, free: Any | None) -> bool:
    """PASS/FAIL for the two targets of ``--scaling``; INFO for what is only reported."""
    verdict = Verdicts()
    for offload in ("thread", "process"):
        speedup = gil["walls"]["serial"] / gil["walls"][f"{offload}/2"]
        print(f"INFO  GIL build, {offload} offload, 2 workers: {speedup:.2f}x serial")
    if free is None:
        verdict(False, "no free-threaded interpreter was measured (give --free-threaded)")
        return verdict.ok
    if not free["free_threaded"]:
        verdict(False, f"the --free-threaded interpreter runs with the GIL: {free['gil']}")
        return verdict.ok
    speedup = free["walls"]["serial"] / free["walls"]["thread/2"]
    verdict(
        speedup >= FREE_THREADED_SPEEDUP_TARGET,
        f"free-threaded build, thread offload, 2 workers: {speedup:.2f}x serial "
        f"(target >= {FREE_THREADED_SPEEDUP_TARGET}x)",
    )
    ratio = free["overhead_us"]["thread"] / gil["overhead_us"]["thread"]
    verdict(
        ratio <= OVERHEAD_RATIO_TARGET,
        f"thread offload overhead per message: {free['overhead_us']['thread']:.1f} µs "
        f"free-threaded, {gil['overhead_us']['thread']:.1f} µs GIL build: {ratio:.2f}x "
        f"(target <= {OVERHEAD_RATIO_TARGET}x)",
    )
    return verdict.ok


def scaling(args: argparse.Namespace) -> int:
    """``--scaling``: measure each interpreter in its own process, print, judge."""
    gil_python = args.gil or sys.executable
    print("asyncbus CPU stages across interpreters")
    print(
        f"  workload : {ENVELOPES} envelopes x "
        f"{_work.ROUNDS // 4 if args.quick else _work.ROUNDS:,} steps of plain Python; "
        f"serial = the same calls in a plain loop; overhead = a do-nothing handler, "
        f"{OVERHEAD_ENVELOPES:,} envelopes, one stage, one worker"
    )
    print(f"  method   : 1 warm-up + {args.repeats} rounds, interleaved; medians")
    gil = measure_in(gil_python, OFFLOADS, args)
    free = measure_in(args.free_threaded, ("thread",), args) if args.free_threaded else None
    results: list[tuple[str, Offload, Any]] = []
    for found, offloads in ((gil, OFFLOADS), (free, ("thread",))):
        if found is None:
            continue
        build = "free-threaded" if found["free_threaded"] else "GIL"
        label = f"{found['version']} ({build}, {found['loop']})"
        print(f"  {label}: {found['executable']}; GIL {found['gil']}")
        results += [(label, offload, found) for offload in offloads]
    print_scaling(results)
    if not args.check:
        return 0
    return 0 if check_scaling(gil, free) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench cpu" if __name__ != "__main__" else None,
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--quick", action="store_true", help="a quarter of the steps, 3 repeats (a smoke run)"
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
        "--scaling",
        action="store_true",
        help="compare this GIL build (thread, process) with a free-threaded one (thread), "
        "each against serial, with the overhead per message",
    )
    parser.add_argument(
        "--free-threaded",
        metavar="PYTHON",
        help="--scaling: a free-threaded interpreter with asyncbus and anyio installed",
    )
    parser.add_argument(
        "--gil",
        metavar="PYTHON",
        help="--scaling: the GIL build to compare with (default: this interpreter)",
    )
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # (--scaling's child processes)
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
    args.repeats = repeats
    if args.scaling or args.measure:
        # Like for like across interpreters: plain asyncio unless asked otherwise.
        args.backend = "asyncio" if args.backend == "default" else args.backend
    if args.scaling:
        return scaling(args)
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
    if args.measure:
        offloads = [offload for offload in OFFLOADS if offload in args.measure.split(",")]
        found = anyio.run(measure, settings, offloads, backend=backend, backend_options=options)
        print(json.dumps(found))
        return 0
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
