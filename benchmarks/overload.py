"""Overload: static settings against adaptive concurrency and sojourn shedding.

``python benchmarks/overload.py [--quick] [--rounds N] [--json PATH] [--check]``

A stage's handler calls a simulated downstream with a knee: ``K`` parallel slots of
``SERVICE`` seconds each; a call that finds ``n > K`` callers inside takes
``SERVICE + (n - K) * EXTRA`` (contention: past the knee, more callers means less
throughput). Its capacity is ``K / SERVICE`` calls a second. The offered load steps
0.5x -> 3x -> 0.5x of that capacity, open loop (a publish that blocks delays the
ones after it, and their latency counts from when they were due).

Per configuration it reports goodput (messages due in the 3x phase handled within
10x the no-load latency, per second), p50/p99 end-to-end latency of what was handled
(from when the message was due to when its handler returned), shed / rejected /
dropped counts, the time after the burst until latency is normal again, the median
adaptive limit during the burst, and whether the ledger balanced exactly. A sweep of
static concurrencies finds the best static setting to compare the adaptive limit to.
The downstream sleeps (``anyio.sleep``), so CPU noise on a shared machine matters
little, and every configuration runs ``--rounds`` times (3 by default), alternating
configurations and loops; the table and the targets take each figure's median over
the rounds, so one stall of a shared machine does not decide. Exits non-zero on a
failed target only with ``--check``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import anyio

from asyncbus import Adaptive, Admission, Backpressure, Bus

SERVICE = 0.020  # seconds per call inside the knee
K = 8  # parallel slots of the downstream
EXTRA = 0.005  # seconds each caller beyond K adds to a call
CAPACITY = K / SERVICE  # calls per second at the knee
TARGET_WAIT = 0.05
INTERVAL = 0.025
BACKENDS: dict[str, dict[str, Any]] = {"asyncio": {}, "uvloop": {"use_uvloop": True}}
SWEEP = (2, 4, 6, 8, 10, 12, 16, 24)


class Downstream:
    """The simulated service: K slots; every caller past them slows every call down."""

    def __init__(self) -> None:
        self.inside = 0

    async def call(self) -> None:
        self.inside += 1
        try:
            await anyio.sleep(SERVICE + max(0, self.inside - K) * EXTRA)
        finally:
            self.inside -= 1


@dataclass(frozen=True)
class Config:
    name: str
    concurrency: int | Adaptive
    backpressure: Backpressure = Backpressure.BLOCK
    capacity: int = 1024
    admission: Admission | None = None


def configurations() -> list[Config]:
    adaptive = Adaptive(min=1, max=256)
    admission = Admission(target_wait=TARGET_WAIT, interval=INTERVAL)
    return [
        Config("BLOCK c=4", 4),
        Config(f"BLOCK c={K} (k)", K),
        Config("BLOCK c=64", 64),
        Config(f"REJECT c={K}", K, Backpressure.REJECT),
        Config(f"DROP_OLDEST c={K}", K, Backpressure.DROP_OLDEST),
        Config("adaptive", adaptive),
        Config(f"shedding c={K}", K, admission=admission),
        Config("adaptive + shedding", adaptive, admission=admission),
    ]


@dataclass
class Result:
    config: str
    backend: str
    offered: int = 0
    handled: int = 0
    goodput: float = 0.0  # per second, messages due in the 3x phase handled in time
    goodput_share: float = 0.0  # of the downstream's capacity
    p50: float = 0.0
    p99: float = 0.0
    burst_p99: float = 0.0
    shed: int = 0
    rejected: int = 0
    dropped: int = 0
    abandoned: int = 0
    unpublished: int = 0
    recovery: float | None = None
    limit: float | None = None
    ledger: bool = False
    ledger_detail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def schedule(phases: list[tuple[float, float]]) -> tuple[list[float], list[tuple[float, float]]]:
    """Due times (seconds from start) of every message, and each phase's (start, end)."""
    times: list[float] = []
    bounds: list[tuple[float, float]] = []
    start = 0.0
    for load, duration in phases:
        interval = 1.0 / (load * CAPACITY)
        count = round(duration / interval)
        times += [start + i * interval for i in range(count)]
        bounds.append((start, start + duration))
        start += duration
    return times, bounds


async def run_one(
    config: Config, phases: list[tuple[float, float]], no_load: float, grace: float
) -> Result:
    clock: Callable[[], float] = anyio.current_time
    downstream = Downstream()
    due, bounds = schedule(phases)
    done: list[float] = [-1.0] * len(due)
    bus = Bus(dead_letter_maxlen=1_000_000)

    async def handle(index: int) -> None:
        await downstream.call()
        done[index] = clock()

    bus.subscribe(
        "work",
        handle,
        group="worker",
        concurrency=config.concurrency,
        capacity=config.capacity,
        backpressure=config.backpressure,
        admission=config.admission,
    )
    result = Result(config.name, "")
    attempted = 0
    limits: list[tuple[float, int]] = []
    async with bus:
        origin = clock() + 0.01
        stop_sampling = anyio.Event()

        async def publisher() -> None:
            nonlocal attempted
            for index, at in enumerate(due):
                delay = origin + at - clock()
                if delay > 0.001:
                    await anyio.sleep(delay)
                receipt = await bus.publish("work", index)
                attempted = index + 1  # returned: admitted or rejected at the door
                if receipt.rejected:
                    done[index] = -2.0

        async def sampler() -> None:
            while not stop_sampling.is_set():
                stage = bus.statistics().stages[0]
                limits.append((clock() - origin, stage.limit))
                with anyio.move_on_after(0.02):
                    await stop_sampling.wait()

        async with anyio.create_task_group() as group:
            group.start_soon(sampler)
            with anyio.move_on_after(due[-1] + 0.011 + grace):
                await publisher()
                await bus.drain()
            stop_sampling.set()
        published_due = attempted
        report = await bus.aclose(timeout=0.05)
        stats = bus.statistics().stages[0]
    offered = len(due)
    deadline = 10 * no_load
    latencies = [(done[i] - (origin + due[i]), due[i]) for i in range(offered) if done[i] >= 0.0]
    burst_start, burst_end = bounds[1] if len(bounds) > 1 else bounds[0]
    burst = [lat for lat, at in latencies if burst_start <= at < burst_end]
    in_time = [lat for lat in burst if lat <= deadline]
    result.offered = offered
    result.handled = len(latencies)
    result.goodput = len(in_time) / (burst_end - burst_start)
    result.goodput_share = result.goodput / CAPACITY
    every = sorted(lat for lat, _ in latencies)
    result.p50 = _quantile(every, 0.5)
    result.p99 = _quantile(every, 0.99)
    result.burst_p99 = _quantile(sorted(burst), 0.99)
    result.shed, result.rejected, result.dropped = stats.shed, stats.rejected, stats.dropped
    result.abandoned = len(report.abandoned)
    # Offered = admitted + rejected at the door + never published (the publisher was
    # still blocked or behind when the run ended); admitted = the stage's ledger.
    result.unpublished = offered - published_due
    admitted_ok = stats.published == stats.acked + stats.dead_lettered + stats.abandoned
    door_ok = offered == stats.published + stats.rejected + result.unpublished
    handled_ok = stats.acked == result.handled
    dead_ok = stats.dead_lettered == stats.shed + stats.dropped
    report_ok = (report.published, report.completed, report.dead_lettered) == (
        stats.published,
        stats.acked,
        stats.dead_lettered,
    )
    result.ledger = admitted_ok and door_ok and handled_ok and dead_ok and report_ok
    result.ledger_detail = (
        f"offered {offered} = published {stats.published} + rejected {stats.rejected} + "
        f"unpublished {result.unpublished}; published = acked {stats.acked} + dead "
        f"{stats.dead_lettered} (shed {stats.shed}, dropped {stats.dropped}) + abandoned "
        f"{stats.abandoned}"
    )
    if len(bounds) > 2:
        result.recovery = _recovery(done, due, origin, burst_end, bounds[2][1], no_load)
    if isinstance(config.concurrency, Adaptive):
        middle = (burst_start + burst_end) / 2
        during = [limit for at, limit in limits if middle <= at < burst_end]
        result.limit = statistics.median(during) if during else None
    return result


def _recovery(
    done: list[float], due: list[float], origin: float, start: float, end: float, no_load: float
) -> float | None:
    """Seconds after ``start`` from which every 100 ms window is normal to the end.

    A window (by due time) is normal when at least 95 % of its messages were handled
    within twice the no-load latency.
    """
    width = 0.1
    windows = int((end - start) / width)
    normal: list[bool] = []
    for w in range(windows):
        low, high = start + w * width, start + (w + 1) * width
        members = [i for i, at in enumerate(due) if low <= at < high]
        fine = sum(1 for i in members if done[i] >= 0 and done[i] - origin - due[i] <= 2 * no_load)
        normal.append(not members or fine >= 0.95 * len(members))
    last_bad = max((w for w, ok in enumerate(normal) if not ok), default=-1)
    if last_bad == windows - 1:
        return None
    return (last_bad + 1) * width


def _quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_no_load() -> float:
    """Median end-to-end latency of one message at a time, through one stage."""
    downstream = Downstream()
    bus = Bus()
    finished = anyio.Event()
    samples: list[float] = []
    started = 0.0

    async def handle(_: int) -> None:
        await downstream.call()
        samples.append(anyio.current_time() - started)
        finished.set()

    bus.subscribe("work", handle, group="worker", concurrency=K)
    async with bus:
        for index in range(40):
            finished = anyio.Event()
            started = anyio.current_time()
            await bus.publish("work", index)
            await finished.wait()
    return statistics.median(samples)


def run(backend: str, coroutine: Callable[..., Any], *args: Any) -> Any:
    return anyio.run(coroutine, *args, backend="asyncio", backend_options=BACKENDS[backend])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (about a minute)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of every configuration (3; quick: 1)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the table as JSON")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--backend", choices=sorted(BACKENDS), action="append")
    options = parser.parse_args(argv)
    backends = options.backend or list(BACKENDS)
    scale = 0.5 if options.quick else 1.0
    rounds = options.rounds or (1 if options.quick else 3)
    phases = [(0.5, 1.5 * scale), (3.0, 3.0 * scale), (0.5, 2.0 * scale)]
    began = time.perf_counter()
    print(
        f"downstream: {K} slots of {SERVICE * 1000:.0f} ms, +{EXTRA * 1000:.1f} ms per caller "
        f"beyond; capacity {CAPACITY:.0f}/s; load 0.5x {phases[0][1]:g}s -> 3x "
        f"{phases[1][1]:g}s -> 0.5x {phases[2][1]:g}s; shedding target_wait "
        f"{TARGET_WAIT * 1000:.0f} ms, interval {INTERVAL * 1000:.0f} ms"
    )
    no_load = {backend: run(backend, measure_no_load) for backend in backends}
    for backend, value in no_load.items():
        print(f"no-load latency {backend}: {value * 1000:.2f} ms (deadline {value * 10000:.0f} ms)")

    # The sweep: throughput of static BLOCK stages at 3x, to find the best static setting.
    sweep: dict[str, dict[int, float]] = {backend: {} for backend in backends}
    sweep_phase = [(3.0, 1.5 * scale)]
    for concurrency in SWEEP:
        for backend in backends:
            outcome = run(
                backend,
                run_one,
                Config(f"c={concurrency}", concurrency),
                sweep_phase,
                no_load[backend],
                0.0,
            )
            sweep[backend][concurrency] = outcome.handled / sweep_phase[0][1]
    best = {backend: max(sweep[backend], key=lambda c: sweep[backend][c]) for backend in backends}
    for backend in backends:
        row = "  ".join(f"c={c}: {rate:.0f}/s" for c, rate in sweep[backend].items())
        print(f"sweep {backend}: {row}  -> best c={best[backend]}")

    every: list[Result] = []
    for _ in range(rounds):
        for config in configurations():
            for backend in backends:
                outcome = run(backend, run_one, config, phases, no_load[backend], 1.0)
                outcome.backend = backend
                every.append(outcome)
    results = [
        _median([r for r in every if (r.config, r.backend) == (config.name, backend)])
        for config in configurations()
        for backend in backends
    ]
    print(f"\nmedians of {rounds} round(s)")
    _print_table(results)
    failures = _targets(results, no_load, best)
    if options.json:
        with open(options.json, "w") as stream:
            json.dump(
                {
                    "downstream": {
                        "slots": K,
                        "service": SERVICE,
                        "extra": EXTRA,
                        "capacity": CAPACITY,
                    },
                    "phases": phases,
                    "admission": {"target_wait": TARGET_WAIT, "interval": INTERVAL},
                    "no_load": no_load,
                    "sweep": {b: {str(c): r for c, r in s.items()} for b, s in sweep.items()},
                    "best_static": best,
                    "rounds": rounds,
                    "results": [asdict(result) for result in results],
                    "every_round": [asdict(result) for result in every],
                    "failures": failures,
                },
                stream,
                indent=2,
            )
    print(f"\ntotal time {time.perf_counter() - began:.0f} s")
    return 1 if failures and options.check else 0


def _median(rounds: list[Result]) -> Result:
    """Each figure's median over the rounds of one configuration; the ledger must hold in all."""
    first = rounds[0]

    def middle(values: list[float | None]) -> float | None:
        known = [value for value in values if value is not None]
        if len(known) * 2 <= len(values):  # mostly never recovered: never
            return None
        return float(statistics.median(known))

    def figure(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in rounds))

    counts = ("offered", "handled", "shed", "rejected", "dropped", "abandoned", "unpublished")
    return Result(
        config=first.config,
        backend=first.backend,
        **{name: round(figure(name)) for name in counts},
        goodput=figure("goodput"),
        goodput_share=figure("goodput_share"),
        p50=figure("p50"),
        p99=figure("p99"),
        burst_p99=figure("burst_p99"),
        recovery=middle([r.recovery for r in rounds]),
        limit=middle([r.limit for r in rounds]),
        ledger=all(r.ledger for r in rounds),
        ledger_detail="; ".join(r.ledger_detail for r in rounds if not r.ledger),
    )


def _print_table(results: list[Result]) -> None:
    print()
    print(
        f"{'configuration':<22}{'backend':<9}{'goodput/s':>10}{'of cap':>8}{'p50 ms':>8}"
        f"{'p99 ms':>8}{'3x p99':>8}{'shed':>7}{'rej':>7}{'drop':>7}{'aband':>7}{'unpub':>7}"
        f"{'recover':>9}{'limit':>7}  ledger"
    )
    for r in results:
        recovery = "never" if r.recovery is None else f"{r.recovery:.1f}s"
        limit = "-" if r.limit is None else f"{r.limit:.0f}"
        print(
            f"{r.config:<22}{r.backend:<9}{r.goodput:>10.0f}{r.goodput_share:>8.0%}"
            f"{r.p50 * 1000:>8.1f}{r.p99 * 1000:>8.1f}{r.burst_p99 * 1000:>8.1f}{r.shed:>7}"
            f"{r.rejected:>7}{r.dropped:>7}{r.abandoned:>7}{r.unpublished:>7}{recovery:>9}"
            f"{limit:>7}  {'exact' if r.ledger else 'WRONG: ' + r.ledger_detail}"
        )


def _targets(results: list[Result], no_load: dict[str, float], best: dict[str, int]) -> list[str]:
    print("\ntargets (adaptive + shedding, per backend):")
    failures: list[str] = []

    def verdict(name: str, ok: bool, detail: str) -> None:
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<58} {detail}")
        if not ok:
            failures.append(name)

    for r in results:
        if r.config != "adaptive + shedding":
            continue
        bound = 2 * TARGET_WAIT + SERVICE
        verdict(
            f"{r.backend}: 3x p99 <= 2 x target_wait + service",
            r.burst_p99 <= bound,
            f"{r.burst_p99 * 1000:.1f} ms <= {bound * 1000:.0f} ms",
        )
        verdict(
            f"{r.backend}: 3x goodput >= 90% of capacity",
            r.goodput_share >= 0.9,
            f"{r.goodput_share:.0%} ({r.goodput:.0f}/s of {CAPACITY:.0f}/s)",
        )
        low, high = 0.75 * best[r.backend], 1.25 * best[r.backend]
        verdict(
            f"{r.backend}: limit within 25% of the best static concurrency",
            r.limit is not None and low <= r.limit <= high,
            f"limit {r.limit} vs best static {best[r.backend]}",
        )
        verdict(
            f"{r.backend}: latency normal within 1 s of the burst's end",
            r.recovery is not None and r.recovery <= 1.0,
            "never" if r.recovery is None else f"{r.recovery:.1f} s",
        )
    wrong = [f"{r.config} on {r.backend}" for r in results if not r.ledger]
    verdict("every configuration's ledger exact", not wrong, ", ".join(wrong) or "all exact")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
