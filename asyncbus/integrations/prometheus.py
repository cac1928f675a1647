"""Prometheus metrics of a bus, read from its statistics at scrape time.

Install with ``pip install 'asyncbus[prometheus]'``. ``import asyncbus`` never imports
this module.

.. code-block:: python

    from prometheus_client import REGISTRY

    from asyncbus.integrations.prometheus import BusCollector

    REGISTRY.register(BusCollector(bus))

or serve them from the admin app: ``admin_app(bus, metrics=True)`` answers
``GET /metrics``. A process with several buses gives them all to one collector
(``BusCollector(orders_bus, billing_bus)``).

Nothing is added to the bus's hot path: every scrape reads
:meth:`Bus.statistics` (the numbers the dashboard shows), the stages' latency
histograms and the dead-letter queue's counts. Over a broker, the broker's backlog per
stage is asked for in the background (every ``backlog_interval`` seconds, by a task
in the bus's task group, started by the first scrape of a running bus); a scrape only
reads the last answer.

Every metric is labelled ``bus`` (the bus's name), and the per-stage ones ``stage``
(``pattern@group``), ``pattern`` and ``group``:

* counters, one per ledger column: ``asyncbus_stage_published_total`` (admitted at the
  door), ``_acked_total``, ``_failed_total`` (failed attempts), ``_retried_total``
  (attempts scheduled again), ``_deferred_total`` (put back by a ``Defer``, not a
  failure), ``_dead_lettered_total`` (any reason), ``_rejected_total``
  (refused at a full REJECT stage's door), ``_dropped_total``, ``_expired_total``,
  ``_shed_total`` (these three are parts of dead-lettered) and ``_abandoned_total``
  (cancelled unsettled at shutdown);
* gauges: ``asyncbus_stage_depth`` (queued), ``_in_flight`` (with a consumer or a retry
  timer), ``_concurrency`` (consumer tasks), ``_capacity`` (queue bound), ``_limit``
  (consumers it should run now), ``_saturation`` (busy consumers / limit, 0 to 1), ``_shedding``
  (1 while an ``admission=`` stage sheds);
* histograms: ``asyncbus_stage_latency_seconds`` (pick-up to settlement) and
  ``asyncbus_stage_wait_seconds`` (admission to pick-up);
* over a broker: ``asyncbus_stage_backlog`` (unsettled in the broker) and
  ``asyncbus_backlog_refreshed_timestamp_seconds`` (when it was last read);
* ``asyncbus_dead_letters`` (in the queue now, by ``reason``),
  ``asyncbus_dead_letters_evicted_total`` (evicted from the full queue) and
  ``asyncbus_bus_running`` (1 while the bus accepts publishes);
* time: ``asyncbus_scheduled`` (envelopes published with ``delay=``/``at=`` and not due
  yet, this process's) and, per periodic schedule (labels ``bus``, ``schedule``,
  ``topic``), ``asyncbus_schedule_next_fire_timestamp_seconds``,
  ``_last_fire_timestamp_seconds``, ``_fired_total`` (ticks this process published) and
  ``_last_outcome`` (1, labelled ``outcome``: ``published``, ``published elsewhere``,
  ``skipped`` or ``failed``);
* with ``Bus(outbox=...)``: ``asyncbus_outbox_pending`` (envelopes published with
  ``connection=`` whose transaction committed, waiting in the outbox for its relay, as the
  relay last counted them: ``statistics().outbox_pending``). Replicas sharing the outbox's
  schema count the same rows: aggregate with ``max``.

The two histograms come from the bus's own fixed logarithmic buckets, exposed at
every octave from 1 µs (1, 2, 4 µs … about 71 minutes), over the envelopes the bus
times: one in eight on a plain stage (so ``_count`` is about an eighth of what was
handled), every one on a controlled stage (``admission=`` or ``Adaptive``).
``asyncbus_dead_letters`` carries ``reason`` and the stage labels (empty for
``no_subscribers``, which reached no stage). Over a broker the dead letters are one list
for every process, so each process reports all of them: aggregate with ``max``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
import anyio.abc

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "asyncbus.integrations.prometheus needs the 'prometheus' extra: "
        "pip install 'asyncbus[prometheus]'"
    ) from error

from .._bus import DEADLETTER_TOPIC, Bus
from .._exceptions import BusClosedError, ConfigurationError
from .._observe import bus_state, dead_letter_counts, on_loop, stage_timings
from .._observe import task_group as bus_task_group
from .._stats import BusStatistics, LatencyHistogram
from ..transports.base import BacklogReader

__all__ = ["BusCollector", "exposition"]

logger = logging.getLogger("asyncbus.integrations.prometheus")

_STAGE_LABELS = ("bus", "stage", "pattern", "group")
#: Ledger column -> what its counter counts.
_COUNTERS = {
    "published": "Envelopes admitted at the stage's door.",
    "acked": "Envelopes handled and acked.",
    "failed": "Failed handling attempts (the last one included).",
    "retried": "Failed attempts scheduled to run again.",
    "deferred": "Envelopes put back by a Defer verdict (not failures, not attempts).",
    "dead_lettered": "Envelopes dead-lettered, whatever the reason.",
    "rejected": "Publishes refused at the door of a full REJECT stage (never published).",
    "dropped": "Envelopes dropped by a full DROP_* stage (part of dead_lettered).",
    "expired": "Envelopes expired before handling (part of dead_lettered).",
    "abandoned": "Envelopes cancelled unsettled when the bus closed.",
    "shed": "Envelopes shed under overload by an admission= stage (part of dead_lettered).",
}
_GAUGES = {
    "depth": "Envelopes queued in the stage.",
    "in_flight": "Envelopes with a consumer or waiting for a retry.",
    "concurrency": "Consumer tasks of the stage (alive, retiring ones included).",
    "capacity": "Most envelopes the stage queues.",
    "limit": "Consumers the stage should run now (an Adaptive stage's current limit).",
    "saturation": "Consumers holding work / limit (0 to 1): how busy the consumers are.",
    "shedding": "1 while an admission= stage sheds stale envelopes, else 0.",
    "keys_held": "Keys an ordering='key' stage holds (one envelope of each under way).",
    "keys_waiting": "Keys of an ordering='key' stage with envelopes waiting for their turn.",
    "waiting_for_key": "Envelopes waiting for their key's turn (part of depth).",
    "slots_held": "Handlers of this process holding a max_in_flight slot of the group.",
    "slots_waiting": "Handlers of this process waiting for a max_in_flight slot.",
    "partitions_owned": "Partitions of an ordered group this process serves (over a broker).",
}


@dataclass(frozen=True, slots=True)
class _Histogram:
    """A latency histogram as Prometheus takes it: cumulative buckets and the sum."""

    buckets: list[tuple[str, float]]
    total: float

    @classmethod
    def of(cls, histogram: LatencyHistogram) -> _Histogram:
        buckets = [(repr(edge), float(seen)) for edge, seen in histogram.cumulative()]
        buckets.append(("+Inf", float(histogram.count)))
        return cls(buckets, histogram.total)


@dataclass(frozen=True, slots=True)
class _Reading:
    """What one scrape read of one bus, on the bus's thread."""

    bus: str
    statistics: BusStatistics
    #: Stage name -> (latency, wait).
    timings: dict[str, tuple[_Histogram, _Histogram]]
    dead_letters: dict[tuple[str | None, str], int]
    evicted: int
    running: bool
    over_broker: bool
    #: Stage name -> unsettled in the broker, as last read in the background.
    backlog: dict[str, int]
    backlog_refreshed: float | None


class _Watched:
    """One bus of a collector, and its broker backlog as last read."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.backlog: dict[str, int] = {}
        self.refreshed: float | None = None
        self.refreshing_in: anyio.abc.TaskGroup | None = None

    @property
    def over_broker(self) -> bool:
        transport = self.bus.transport
        return transport is not None and not transport.direct

    async def refresh(self, timeout: float) -> None:
        transport = self.bus.transport
        if transport is None or transport.direct or not isinstance(transport, BacklogReader):
            return
        for stage in self.bus.statistics().stages:
            if stage.topic == DEADLETTER_TOPIC:
                continue  # announcements never leave the process
            try:
                with anyio.fail_after(timeout):
                    count = await transport.backlog(stage.topic, stage.group)
            except Exception as error:  # TimeoutError included: keep the last value
                logger.debug("backlog of %s not read: %r", stage.name, error)
                continue
            self.backlog[stage.name] = int(count)
        self.refreshed = time.time()

    def read(self, start_refreshing: Callable[[_Watched], None]) -> _Reading:
        # On the bus's thread: one consistent snapshot.
        bus = self.bus
        start_refreshing(self)
        timings = {
            name: (_Histogram.of(latency), _Histogram.of(wait))
            for name, (latency, wait) in stage_timings(bus).items()
        }
        return _Reading(
            bus=bus.name,
            statistics=bus.statistics(),
            timings=timings,
            dead_letters=dead_letter_counts(bus),
            evicted=bus.dead_letters.evicted,
            running=bus_state(bus) == "running",
            over_broker=self.over_broker,
            backlog=dict(self.backlog),
            backlog_refreshed=self.refreshed,
        )


class BusCollector(Collector):
    """A Prometheus collector of a bus (or of several); register it with a registry.

    One registry takes one collector of a bus: for several buses in one process, give
    them to one collector (``BusCollector(orders_bus, billing_bus)``, each with its own
    ``name``), so every metric family is exposed once.

    :param bus: the bus to report (running or not); ``more`` are reported beside it.
    :param backlog_interval: seconds between two reads of the broker's backlog (over a
        broker; in memory there is none).
    :param backlog_timeout: longest wait for one stage's backlog; a stage whose broker
        does not answer in time keeps its previous value.
    :raises ConfigurationError: for an interval or timeout that is not a positive number,
        or two buses of the same name.
    """

    def __init__(
        self,
        bus: Bus,
        *more: Bus,
        backlog_interval: float = 15.0,
        backlog_timeout: float = 5.0,
    ) -> None:
        for name, value in (
            ("backlog_interval", backlog_interval),
            ("backlog_timeout", backlog_timeout),
        ):
            if not isinstance(value, int | float) or not value > 0 or value == float("inf"):
                raise ConfigurationError(f"BusCollector: {name} must be > 0, got {value!r}")
        buses = (bus, *more)
        names = [each.name for each in buses]
        if len(set(names)) != len(names):
            raise ConfigurationError(
                f"BusCollector: the buses need distinct names (the 'bus' label), got {names}"
            )
        self.buses = buses
        self.backlog_interval = float(backlog_interval)
        self.backlog_timeout = float(backlog_timeout)
        self._watched = [_Watched(each) for each in buses]

    # -- the background backlog ----------------------------------------------------

    async def refresh_backlog(self) -> None:
        """Ask the broker for every stage's backlog now (what the background task does).

        Await it on the event loop that runs the buses.
        """
        for watched in self._watched:
            await watched.refresh(self.backlog_timeout)

    async def _refresh_forever(self, watched: _Watched) -> None:
        while True:
            await watched.refresh(self.backlog_timeout)
            await anyio.sleep(self.backlog_interval)

    def _start_refreshing(self, watched: _Watched) -> None:
        # On the bus's thread. One task per run of the bus (its task group ends with it).
        if not watched.over_broker:
            return
        try:
            task_group = bus_task_group(watched.bus)
        except BusClosedError:
            return
        if task_group is not watched.refreshing_in:
            watched.refreshing_in = task_group
            task_group.start_soon(
                self._refresh_forever,
                watched,
                name=f"asyncbus backlog metrics {watched.bus.name}",
            )

    # -- scraping ------------------------------------------------------------------

    def describe(self) -> list[Metric]:
        """Every family :meth:`collect` may yield, without values (so a registry can
        refuse a second collector of the same names)."""
        return list(_families([]))

    def collect(self) -> Iterator[Metric]:
        """Read every bus now (each on its own thread) and yield every metric family."""
        readings = [
            on_loop(watched.bus, functools.partial(watched.read, self._start_refreshing))
            for watched in self._watched
        ]
        yield from _families(readings)


def _families(readings: list[_Reading]) -> Iterator[Metric]:
    """The metric families of ``readings`` (without samples for none)."""
    rows = [
        (reading, stage, (reading.bus, stage.name, stage.topic, stage.group))
        for reading in readings
        for stage in reading.statistics.stages
    ]
    for column, documentation in _COUNTERS.items():
        counter = CounterMetricFamily(
            f"asyncbus_stage_{column}", documentation, labels=_STAGE_LABELS
        )
        for _, stage, labels in rows:
            counter.add_metric(labels, getattr(stage, column))
        yield counter

    for column, documentation in _GAUGES.items():
        gauge = GaugeMetricFamily(f"asyncbus_stage_{column}", documentation, labels=_STAGE_LABELS)
        for _, stage, labels in rows:
            gauge.add_metric(labels, float(getattr(stage, column)))
        yield gauge

    latency = HistogramMetricFamily(
        "asyncbus_stage_latency_seconds",
        "Seconds from pick-up to settlement (plain stages time one envelope in eight).",
        labels=_STAGE_LABELS,
    )
    wait = HistogramMetricFamily(
        "asyncbus_stage_wait_seconds",
        "Seconds from admission to pick-up (plain stages time one envelope in eight).",
        labels=_STAGE_LABELS,
    )
    for reading, stage, labels in rows:
        timing = reading.timings.get(stage.name)
        if timing is not None:
            latency.add_metric(labels, timing[0].buckets, timing[0].total)
            wait.add_metric(labels, timing[1].buckets, timing[1].total)
    yield latency
    yield wait

    backlog = GaugeMetricFamily(
        "asyncbus_stage_backlog",
        "Envelopes of the stage unsettled in the broker, as last read in the background.",
        labels=_STAGE_LABELS,
    )
    for reading, stage, labels in rows:
        count = reading.backlog.get(stage.name)
        if reading.over_broker and count is not None:
            backlog.add_metric(labels, count)
    refreshed = GaugeMetricFamily(
        "asyncbus_backlog_refreshed_timestamp_seconds",
        "When the broker's backlog was last read (epoch seconds).",
        labels=("bus",),
    )
    for reading in readings:
        if reading.over_broker and reading.backlog_refreshed is not None:
            refreshed.add_metric((reading.bus,), reading.backlog_refreshed)
    if not readings or any(reading.over_broker for reading in readings):
        yield backlog
        yield refreshed

    dead = GaugeMetricFamily(
        "asyncbus_dead_letters",
        "Dead letters in the queue now, by stage and reason.",
        labels=(*_STAGE_LABELS, "reason"),
    )
    evicted = CounterMetricFamily(
        "asyncbus_dead_letters_evicted",
        "Dead letters evicted because the queue was full.",
        labels=("bus",),
    )
    running = GaugeMetricFamily(
        "asyncbus_bus_running", "1 while the bus accepts publishes, else 0.", labels=("bus",)
    )
    for reading in readings:
        for (stage_name, reason), count in sorted(
            reading.dead_letters.items(), key=lambda item: (item[0][0] or "", item[0][1])
        ):
            pattern, _, group = (stage_name or "").rpartition("@")
            dead.add_metric((reading.bus, stage_name or "", pattern, group, reason), count)
        evicted.add_metric((reading.bus,), reading.evicted)
        running.add_metric((reading.bus,), 1 if reading.running else 0)
    yield dead
    yield evicted
    yield running
    yield from _time_families(readings)

    outbox = GaugeMetricFamily(
        "asyncbus_outbox_pending",
        "Envelopes committed with publish(connection=) waiting in the outbox for its relay, "
        "as the relay last counted them.",
        labels=("bus",),
    )
    for reading in readings:
        if reading.statistics.outbox_pending is not None:
            outbox.add_metric((reading.bus,), reading.statistics.outbox_pending)
    if not readings or any(reading.statistics.outbox_pending is not None for reading in readings):
        yield outbox


def _time_families(readings: list[_Reading]) -> Iterator[Metric]:
    """Scheduled envelopes and periodic schedules (``bus.scheduled()``, ``statistics()
    .schedules``)."""
    scheduled = GaugeMetricFamily(
        "asyncbus_scheduled",
        "Envelopes published with delay=/at= that are not due yet (this process's).",
        labels=("bus",),
    )
    labels = ("bus", "schedule", "topic")
    next_fire = GaugeMetricFamily(
        "asyncbus_schedule_next_fire_timestamp_seconds",
        "The schedule's next tick (epoch seconds).",
        labels=labels,
    )
    last_fire = GaugeMetricFamily(
        "asyncbus_schedule_last_fire_timestamp_seconds",
        "The schedule's last tick published, by this process or another replica.",
        labels=labels,
    )
    fired = CounterMetricFamily(
        "asyncbus_schedule_fired", "Ticks of the schedule this process published.", labels=labels
    )
    outcome = GaugeMetricFamily(
        "asyncbus_schedule_last_outcome",
        "1 for what became of the schedule's last tick: published, published elsewhere, "
        "skipped or failed.",
        labels=(*labels, "outcome"),
    )
    for reading in readings:
        scheduled.add_metric((reading.bus,), reading.statistics.scheduled)
        for schedule in reading.statistics.schedules:
            named = (reading.bus, schedule.name, schedule.topic)
            if schedule.next_fire is not None:
                next_fire.add_metric(named, schedule.next_fire.timestamp())
            if schedule.last_fire is not None:
                last_fire.add_metric(named, schedule.last_fire.timestamp())
            fired.add_metric(named, schedule.fired)
            if schedule.last_outcome is not None:
                kind = schedule.last_outcome.partition(":")[0]
                outcome.add_metric((*named, kind), 1)
    yield scheduled
    yield next_fire
    yield last_fire
    yield fired
    yield outcome


def exposition(bus: Bus) -> Callable[[], tuple[bytes, str]]:
    """A function that renders ``bus``'s metrics: ``(body, content type)`` in the text format.

    It has its own registry holding one :class:`BusCollector` (what ``admin_app(bus,
    metrics=True)`` serves at ``/metrics``); call it on any thread.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BusCollector(bus))

    def render() -> tuple[bytes, str]:
        return generate_latest(registry), CONTENT_TYPE_LATEST

    return render
