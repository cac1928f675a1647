"""The benchmark's vocabulary: samples, implementations, workloads and their statistics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from anyio.lowlevel import checkpoint

__all__ = [
    "RAW",
    "Impl",
    "Measurement",
    "Payload",
    "Sample",
    "Tally",
    "Workload",
    "counting",
    "echoing",
    "make_messages",
    "median",
    "quantile",
    "settle",
]

#: What every workload publishes: a small dict, built before timing starts.
Payload = dict[str, Any]

#: Key of the raw anyio stream baseline that every ratio is taken against.
RAW = "raw"


@dataclass(frozen=True, slots=True)
class Sample:
    """One timed run of one implementation.

    :ivar seconds: wall time from the first publish until the last message was handled.
    :ivar messages: messages published in that time.
    :ivar handled: handler calls counted (checked against what the workload expects).
    :ivar latencies: per-request round trips in seconds (request/reply only).
    :ivar cpu: share of one CPU the process got during the run (CPU time / wall time);
        well below 1 means another process took the CPU and the timing is suspect.
    """

    seconds: float
    messages: int
    handled: int
    latencies: tuple[float, ...] = ()
    cpu: float = 1.0

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.messages / self.seconds if self.seconds > 0 else math.inf

    @property
    def cpu_us_per_message(self) -> float:
        """CPU time of the process per message, in µs."""
        return self.seconds * self.cpu / self.messages * 1e6 if self.messages else math.nan


Runner = Callable[[Sequence[Payload]], Awaitable[Sample]]


@dataclass(frozen=True, slots=True)
class Impl:
    """One implementation of a workload: asyncbus, a baseline, or a peer.

    ``run`` is ``None`` when the implementation cannot run the workload; ``reason``
    then says why (shown as ``n/a (reason)``, never dropped).
    """

    key: str
    label: str
    run: Runner | None
    reason: str = ""
    #: How many messages it gets per run, as a fraction of the workload's count
    #: (the slow peers would take minutes on the full count).
    scale: float = 1.0
    note: str = ""


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload of the suite, and what a correct run handles per message."""

    key: str
    title: str
    handled_per_message: int
    #: Report round-trip quantiles (request/reply).
    latency: bool = False


@dataclass(slots=True)
class Measurement:
    """Every sample of one implementation on one workload and loop, plus the verdicts."""

    workload: Workload
    loop: str
    impl: Impl
    samples: list[Sample] = field(default_factory=list)
    status: str = "ok"  # "ok", "n/a" or "error"
    reason: str = ""
    #: Median over rounds of (this rate / raw rate in the same round).
    ratio: float | None = None
    #: Median over rounds of (this p99 / raw p99 in the same round).
    p99_ratio: float | None = None
    #: Traced rows: median over rounds of (untraced asyncbus's CPU time per message /
    #: this one's, in the same round): 1.0 costs the same, 0.5 twice as much.
    bus_ratio: float | None = None
    #: Runs thrown away and run again because the process was starved of CPU.
    reruns: int = 0

    @property
    def messages(self) -> int:
        return self.samples[0].messages if self.samples else 0

    @property
    def rate(self) -> float:
        """Median messages per second over the rounds."""
        return median([sample.rate for sample in self.samples])

    @property
    def us_per_message(self) -> float:
        rate = self.rate
        return 1e6 / rate if rate > 0 else math.nan

    @property
    def cpu_us_per_message(self) -> float:
        """Median over the rounds of the process's CPU time per message, in µs (what
        another process on the machine cannot add to, unlike wall time)."""
        return median([sample.cpu_us_per_message for sample in self.samples])

    def latency_quantile(self, q: float) -> float:
        """Median over rounds of each round's ``q`` latency quantile, in µs."""
        values = [quantile(s.latencies, q) for s in self.samples if s.latencies]
        return median(values) * 1e6 if values else math.nan


def median(values: Sequence[float]) -> float:
    """Median, NaN for no values."""
    return statistics.median(values) if values else math.nan


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by the nearest-rank method (the value at rank ceil(q·n))."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def make_messages(count: int) -> list[Payload]:
    """Small, distinct dict payloads, all built up front."""
    return [{"id": index, "kind": "order.created", "amount": 12.5} for index in range(count)]


class Tally:
    """Counts handler calls; the handler body of every implementation."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


async def settle() -> None:
    """Let freshly started consumer tasks reach their first ``receive`` before timing."""
    for _ in range(5):
        await checkpoint()


def counting(tally: Tally) -> Callable[[Payload], Awaitable[None]]:
    """The async handler every implementation calls: count the message, nothing else."""

    async def handle(payload: Payload) -> None:
        tally.n += 1

    return handle


def echoing(tally: Tally) -> Callable[[Payload], Awaitable[Payload]]:
    """The request/reply handler: count, and answer with the payload."""

    async def handle(payload: Payload) -> Payload:
        tally.n += 1
        return payload

    return handle
