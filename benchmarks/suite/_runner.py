"""The workloads, their implementations, and the alternating runs that measure them."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from ._asyncbus import bus_runners
from ._baselines import fairness_floor_runners, queue_runners, raw_runners, sync_runners
from ._model import RAW, Impl, Measurement, Sample, Workload, make_messages, median, quantile
from ._peers import FASTSTREAM_NATS, FASTSTREAM_RABBIT, bubus_available, bubus_runners
from ._traced import traced_runners, tracing_unavailable

__all__ = [
    "DEFAULT_IMPLS",
    "FAIRNESS_FLOOR",
    "IMPL_KEYS",
    "LOOPS",
    "TRACED",
    "WORKLOADS",
    "Plan",
    "implementations",
    "log",
    "loop_unavailable",
    "measure",
    "run_on",
]

WORKLOADS: tuple[Workload, ...] = (
    Workload("1", "one stage, one async handler", 1),
    Workload("2", "fan-out to 3 groups", 3),
    Workload("3", "work queue: 1 group, 4 consumers", 1),
    Workload("4", "3-stage routing slip", 3),
    Workload("5", "request/reply round trip", 1, latency=True),
    Workload("6", "one stage, reliability chain", 1),
    Workload("7", "publish_many x100 into one stage, async handler", 1),
    Workload("8", "one stage, batch handler, 100 per publish", 1),
)

#: Label of the fairness floor: two tasks, one yield each per message, no other work.
FAIRNESS_FLOOR = "fairness floor: 2 yields"

#: asyncbus traced with OpenTelemetry: the API alone (no SDK), the SDK sampling
#: nothing, and the SDK recording every span. Opt-in (``--impls``): a traced run takes
#: up to ten times as long as an untraced one.
TRACED = ("otel", "otel-unsampled", "otel-sdk")
IMPL_KEYS = (
    "asyncbus",
    *TRACED,
    RAW,
    "queue",
    "sync",
    "floor",
    "faststream",
    "faststream-rabbit",
    "bubus",
)
#: What runs when ``--impls`` is not given: everything but the traced rows.
DEFAULT_IMPLS = tuple(key for key in IMPL_KEYS if key not in TRACED)
LOOPS = ("asyncio", "uvloop", "trio")

#: No single run may take longer than this (a hung peer must not hang the suite).
RUN_TIMEOUT = 300.0
#: A run in which the process got less of a CPU than this was slowed down by another
#: process (this machine may be shared): it is thrown away and run again.
MIN_CPU_SHARE = 0.85


@dataclass(frozen=True, slots=True)
class Plan:
    """How much to run: message counts, rounds, and what to include."""

    messages: int
    requests: int
    rounds: int
    impls: tuple[str, ...] = DEFAULT_IMPLS
    warmup: bool = True
    #: How often a CPU-starved run may be run again before its best attempt is kept.
    reruns: int = 2


def loop_unavailable(loop: str) -> str | None:
    """``None`` when ``loop`` can run here, else why not."""
    if loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        return "uvloop not installed"
    if loop == "trio" and importlib.util.find_spec("trio") is None:
        return "trio not installed"
    return None


def run_on(loop: str, function: Callable[[], Any]) -> Any:
    """Run ``await function()`` on a fresh event loop of the named kind."""
    if loop == "trio":
        return anyio.run(function, backend="trio")
    return anyio.run(function, backend="asyncio", backend_options={"use_uvloop": loop == "uvloop"})


def implementations(
    workload: Workload, loop: str, include: Sequence[str] = DEFAULT_IMPLS
) -> list[Impl]:
    """The implementations of ``workload`` on ``loop`` named in ``include``, runnable or
    with the reason they are not (peers outside ``include`` are not even imported)."""
    key = workload.key
    on_trio = "needs an asyncio event loop" if loop == "trio" else None
    impls = [Impl("asyncbus", "asyncbus", bus_runners()[key])]
    for traced_key, label in (
        ("otel", "asyncbus traced, no SDK"),
        ("otel-unsampled", "asyncbus traced, unsampled"),
        ("otel-sdk", "asyncbus traced, SDK"),
    ):
        if traced_key in include:
            why = tracing_unavailable(traced_key)
            run = None if why else traced_runners(traced_key)[key]
            impls.append(Impl(traced_key, label, run, why or ""))
    impls += [
        Impl(RAW, "anyio stream (raw)", raw_runners()[key]),
        _maybe("queue", "asyncio.Queue", queue_runners()[key], on_trio),
        Impl("sync", "sync call loop (floor)", sync_runners()[key]),
    ]
    floor = fairness_floor_runners()[key]
    if isinstance(floor, str):
        impls.append(Impl("floor", FAIRNESS_FLOOR, None, floor))
    else:
        impls.append(Impl("floor", FAIRNESS_FLOOR, floor))
    peers: tuple[tuple[str, str, Any, Callable[[], str | None], float], ...] = (
        (
            "faststream",
            "FastStream TestNatsBroker",
            FASTSTREAM_NATS.runners,
            FASTSTREAM_NATS.available,
            1 / 25,
        ),
        (
            "faststream-rabbit",
            "FastStream TestRabbitBroker",
            FASTSTREAM_RABBIT.runners,
            FASTSTREAM_RABBIT.available,
            1 / 100,
        ),
        ("bubus", "bubus EventBus", bubus_runners, bubus_available, 1 / 50),
    )
    for peer_key, label, runners, available, scale in peers:
        if peer_key not in include:
            continue
        why = on_trio or available()
        runner = runners()[key] if why is None else why
        if isinstance(runner, str):
            impls.append(Impl(peer_key, label, None, runner))
        else:
            impls.append(Impl(peer_key, label, runner, scale=scale))
    return [impl for impl in impls if impl.key in include]


def _maybe(key: str, label: str, runner: Any, why: str | None) -> Impl:
    return Impl(key, label, None, why) if why else Impl(key, label, runner)


def _count(plan: Plan, workload: Workload, impl: Impl) -> int:
    base = plan.requests if workload.latency else plan.messages
    return max(50, round(base * impl.scale))


def measure(
    workload: Workload,
    loop: str,
    plan: Plan,
    progress: Callable[[str], None] = lambda _: None,
) -> list[Measurement]:
    """Measure every implementation of ``workload`` on ``loop``, in alternating rounds.

    Each round runs every implementation once, in the same order (A B C … A B C …),
    so slow drifts of the machine hit all of them alike; the median over rounds is
    reported, and each ratio is the median of per-round ratios to the raw stream.
    """
    measurements = [
        Measurement(workload, loop, impl) for impl in implementations(workload, loop, plan.impls)
    ]
    unavailable = loop_unavailable(loop)
    for measurement in measurements:
        if unavailable or measurement.impl.run is None:
            measurement.status = "n/a"
            measurement.reason = unavailable or measurement.impl.reason
    runnable = [m for m in measurements if m.status == "ok"]
    if not runnable:
        return measurements
    messages = make_messages(max(_count(plan, workload, m.impl) for m in runnable))

    async def once(measurement: Measurement, count: int) -> Sample | None:
        run = measurement.impl.run
        assert run is not None
        gc.collect()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            with anyio.fail_after(RUN_TIMEOUT):
                sample = await run(messages[:count])
        except Exception as error:
            measurement.status = "error"
            measurement.reason = f"{type(error).__name__}: {error}"[:200]
            return None
        share = (time.process_time() - cpu) / max(time.perf_counter() - wall, 1e-9)
        expected = count * workload.handled_per_message
        if sample.handled != expected:
            measurement.status = "error"
            measurement.reason = f"handled {sample.handled} of {expected} expected"
            return None
        return dataclasses.replace(sample, cpu=share)

    async def timed(measurement: Measurement) -> None:
        """One timed run; run again (at most ``plan.reruns`` times) while CPU-starved."""
        count = _count(plan, workload, measurement.impl)
        best: Sample | None = None
        for _ in range(1 + plan.reruns):
            sample = await once(measurement, count)
            if sample is None:
                return
            if best is None or sample.cpu > best.cpu:
                best = sample
            if sample.cpu >= MIN_CPU_SHARE:
                break
            measurement.reruns += 1
        if best is not None:
            measurement.samples.append(best)

    async def alternate() -> None:
        if plan.warmup:
            for measurement in runnable:
                await once(measurement, max(50, _count(plan, workload, measurement.impl) // 10))
        for round_index in range(plan.rounds):
            progress(f"  {loop:<7} workload {workload.key}: round {round_index + 1}/{plan.rounds}")
            for measurement in runnable:
                if measurement.status == "ok":
                    await timed(measurement)

    run_on(loop, alternate)
    _ratios(measurements)
    return measurements


def _ratios(measurements: Sequence[Measurement]) -> None:
    bus = next((m for m in measurements if m.impl.key == "asyncbus" and m.status == "ok"), None)
    if bus is not None:
        for traced in measurements:
            if traced.impl.key in TRACED and traced.status == "ok" and traced.samples:
                # By CPU time: other processes on a shared machine move wall time.
                pairs = list(zip(traced.samples, bus.samples, strict=False))
                traced.bus_ratio = median(
                    [theirs.cpu_us_per_message / ours.cpu_us_per_message for ours, theirs in pairs]
                )
    raw = next((m for m in measurements if m.impl.key == RAW and m.status == "ok"), None)
    if raw is None:
        return
    for measurement in measurements:
        if measurement.status != "ok" or not measurement.samples:
            continue
        pairs = list(zip(measurement.samples, raw.samples, strict=False))
        measurement.ratio = median([ours.rate / theirs.rate for ours, theirs in pairs])
        if measurement.workload.latency:
            measurement.p99_ratio = median(
                [_p99(ours.latencies) / _p99(theirs.latencies) for ours, theirs in pairs]
            )


def _p99(latencies: Sequence[float]) -> float:
    return quantile(latencies, 0.99)


def log(line: str) -> None:
    """Progress goes to stderr, so stdout holds only the report."""
    print(line, file=sys.stderr, flush=True)
