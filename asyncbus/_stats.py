"""Statistics snapshots and the streaming latency estimator behind them."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field
from datetime import datetime

__all__ = [
    "BusStatistics",
    "LatencyHistogram",
    "ShutdownReport",
    "StageStatistics",
]

# Buckets grow by 2**(1/8) (about 9 %), from 1 µs to about 2.3 hours: fixed memory,
# any quantile within one bucket's width.
_STEPS_PER_OCTAVE = 8
_SMALLEST = 1e-6
_BUCKETS = 8 * 33
#: Each bucket's lower edge but the first's: a duration's bucket is the number of edges
#: at or below it, found by bisection in C (consumers record one envelope in eight, so
#: this is cheaper than the logarithm it stands for).
_EDGES = tuple(_SMALLEST * 2 ** (index / _STEPS_PER_OCTAVE) for index in range(_BUCKETS - 1))


class LatencyHistogram:
    """Quantiles of durations from a fixed set of logarithmic buckets.

    Recording is O(1) and memory never grows, whatever the message count.
    """

    __slots__ = ("_counts", "count", "total")

    def __init__(self) -> None:
        self._counts = [0] * _BUCKETS
        self.count = 0
        #: Sum of every duration recorded, in seconds.
        self.total = 0.0

    def record(self, seconds: float) -> None:
        """Add one observed duration."""
        self._counts[bisect_right(_EDGES, seconds) if seconds > _SMALLEST else 0] += 1
        self.count += 1
        self.total += seconds

    def quantile(self, q: float) -> float:
        """Return the ``q`` quantile (0 < q <= 1) in seconds, 0.0 when nothing was recorded."""
        if not self.count:
            return 0.0
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for index, count in enumerate(self._counts):
            seen += count
            if seen >= rank:
                # Upper edge of the bucket: never under-reports.
                return _SMALLEST * 2 ** (index / _STEPS_PER_OCTAVE)
        return _SMALLEST * 2 ** (_BUCKETS / _STEPS_PER_OCTAVE)  # pragma: no cover

    def cumulative(self, every: int = _STEPS_PER_OCTAVE) -> list[tuple[float, int]]:
        """Durations recorded up to each ``every``-th bucket edge: ``(seconds, count)``.

        Exact (the edges are bucket edges), ascending from 1 µs; the default step is
        one octave (each edge twice the last). The last bucket, which also holds every
        longer duration, has no upper edge: it is what ``count`` adds above the last.
        """
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every!r}")
        edges: list[tuple[float, int]] = []
        seen = 0
        for index, count in enumerate(self._counts[:-1]):
            seen += count
            if index % every == 0:
                edges.append((_SMALLEST * 2 ** (index / _STEPS_PER_OCTAVE), seen))
        return edges


@dataclass(frozen=True, slots=True)
class StageStatistics:
    """One stage's ledger and timings at the moment :meth:`Bus.statistics` was called.

    ``published == acked + dead_lettered + abandoned + depth + in_flight`` holds at
    every moment; envelopes waiting for a retry count as ``in_flight``. ``dropped``
    and ``expired`` are parts of ``dead_lettered``; ``rejected`` (refused at the door)
    is never part of ``published``; ``shed`` is part of ``dead_lettered`` too.
    ``failed`` counts failed attempts, ``retried``
    the attempts scheduled again. Latencies are in seconds: ``latency_*`` from pick-up
    to settlement, ``wait_p99`` from admission to pick-up.
    """

    name: str
    topic: str
    group: str
    published: int
    acked: int
    failed: int
    retried: int
    dead_lettered: int
    rejected: int
    dropped: int
    expired: int
    depth: int
    in_flight: int
    concurrency: int
    latency_p50: float
    latency_p99: float
    wait_p99: float
    # Added after the documented fields, each with a default: a StageStatistics made
    # with the documented fields alone (by position or by name) still works.
    #: Envelopes listed as abandoned at shutdown.
    abandoned: int = 0
    #: The stage's queue capacity (0 when not given).
    capacity: int = 0
    #: Consumers the stage should run now: ``concurrency`` for a static stage; the
    #: controller's current limit for ``concurrency=Adaptive(...)`` (``concurrency``
    #: then counts the consumers alive, retiring ones included).
    limit: int = 0
    #: Whether an ``admission=`` stage is shedding stale envelopes now.
    shedding: bool = False
    #: Envelopes shed under overload (dead-lettered ``overload``; part of ``dead_lettered``).
    shed: int = 0
    #: How busy the consumers are, 0 to 1 (see "Saturation" in the README): consumers
    #: holding work / ``limit``, at most 1. A batch consumer counts once however many
    #: envelopes it holds; envelopes waiting for a retry (in ``in_flight``) hold none.
    saturation: float = 0.0
    #: Times an envelope was put back by a ``Defer`` verdict (not failures, not attempts;
    #: the envelope counts ``in_flight`` while it waits).
    deferred: int = 0
    #: ``"key"`` for a stage subscribed with ``ordering="key"``, else ``None``.
    ordering: str | None = None
    #: An ordered stage's keys held now: one envelope of each is queued, in flight or
    #: waiting for a retry.
    keys_held: int = 0
    #: An ordered stage's keys that have envelopes waiting for their turn.
    keys_waiting: int = 0
    #: Envelopes waiting for their key's turn (a part of ``depth``).
    waiting_for_key: int = 0
    #: ``subscribe(max_in_flight=...)``: the most handlers of the group at once, in every
    #: replica together; ``None`` when not given.
    max_in_flight: int | None = None
    #: Handlers of this process holding one of those slots now.
    slots_held: int = 0
    #: Handlers of this process waiting for a slot (all taken, here or elsewhere).
    slots_waiting: int = 0
    #: ``subscribe(partitions=...)``: the partitions of an ordered group; ``None`` when
    #: not given.
    partitions: int | None = None
    #: The partitions this process serves now: over a broker those it holds (summed
    #: over a deployment: ``partitions`` once every one is served); in memory, all.
    partitions_owned: int = 0


@dataclass(frozen=True, slots=True)
class BusStatistics:
    """Every stage's statistics plus bus-wide totals (fan-out counts once per stage)."""

    stages: tuple[StageStatistics, ...]
    published: int
    acked: int
    failed: int
    retried: int
    dead_lettered: int
    rejected: int
    dropped: int
    expired: int
    # The totals past ``expired`` have defaults: made without them, they are zero.
    abandoned: int = 0
    depth: int = 0
    in_flight: int = 0
    #: Entries in the dead-letter queue.
    dead_letter_queue: int = 0
    #: Whether sync handlers run truly in parallel (a free-threaded build).
    free_threaded: bool = False
    #: Times envelopes were put back by a ``Defer`` verdict, every stage's.
    deferred: int = 0
    #: Envelopes published with ``delay=``/``at=`` that are not due yet (over a broker,
    #: those this process scheduled; the broker holds every process's).
    scheduled: int = 0
    #: Every periodic schedule of the bus (``bus.schedule``, ``@bus.periodic``).
    schedules: tuple[ScheduleStatistics, ...] = ()
    #: Envelopes published with ``connection=`` whose transaction committed and that wait
    #: in the outbox for its relay (``Bus(outbox=...)``), as the relay last counted them:
    #: when the bus started, then every ``poll_interval``, less what it forwarded since.
    #: The table is shared by every bus on the outbox's schema. ``None`` without an outbox.
    outbox_pending: int | None = None

    def stage(self, name: str) -> StageStatistics:
        """Return the statistics of the stage called ``name`` (``"pattern@group"``).

        :raises KeyError: when no stage has that name.
        """
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class ScheduleStatistics:
    """One periodic schedule: when it fires, what it did last.

    :ivar name: the schedule's name (the same in every replica).
    :ivar topic: where its ticks are published.
    :ivar when: ``"every 300 s"`` or ``"cron */5 * * * * (Europe/Paris)"``.
    :ivar next_fire: its next tick, an aware UTC datetime (``None`` before the start).
    :ivar last_fire: the last tick published, by this process or another replica.
    :ivar last_outcome: ``"published"``, ``"published elsewhere"``, ``"skipped"``
        (a missed tick, ``catch_up="skip"``) or ``"failed: ..."``.
    :ivar fired: ticks this process published.
    """

    name: str
    topic: str
    when: str
    next_fire: datetime | None
    last_fire: datetime | None
    last_outcome: str | None
    fired: int


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What :meth:`Bus.aclose` found: ``published == completed + dead_lettered + len(abandoned)``.

    :ivar drained: whether everything finished before the deadline.
    :ivar abandoned: ids of the envelopes cancelled at the deadline (one per stage).
    :ivar scheduled: ids of the envelopes published with ``delay=``/``at=`` that were
        not due yet: in memory (and over a transport that is not durable) they are
        abandoned with the bus, never published; a broker keeps them and this list is
        empty.
    """

    drained: bool
    published: int
    completed: int
    dead_lettered: int
    abandoned: list[str]
    scheduled: list[str] = field(default_factory=list)
