"""One view of the deployment: every process's statistics, through the broker.

Over a broker, each process of a deployment has its own ledger; an operator wants the
deployment's. So every bus whose transport keeps heartbeats (the optional
:class:`Heartbeats` capability) writes one at an interval, through the broker: a small
JSON record (never pickle) of who it is (host, pid, an instance id, its bus's name, when
it started) and its statistics. The same round reads every process's record, which is
the view :meth:`Bus.cluster_statistics` returns (per process, and summed). A process
not heard from for three of its own intervals is *stale* (killed, partitioned, or its
event loop stuck); the broker forgets a record some minutes after its last write
(:data:`FORGET_AFTER`), and a bus that closes deletes its own.

In memory, or over a transport without heartbeats, the view is this process alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import anyio

from ._checks import check_seconds
from ._stats import BusStatistics, StageStatistics

__all__ = [
    "FORGET_AFTER",
    "ClusterStatistics",
    "ClusterWatch",
    "Heartbeats",
    "ProcessStatistics",
    "check_heartbeat",
    "sum_statistics",
]

logger = logging.getLogger("asyncbus.cluster")

#: Seconds after its last heartbeat that a process's record is dropped from the broker.
FORGET_AFTER = 300.0

#: Heartbeats missed before a process is marked stale.
_MISSED = 3

#: The record's version; a record of another version is skipped.
_VERSION = 1

_STAGE_FIELDS = {field.name for field in dataclasses.fields(StageStatistics)}
_TOTAL_FIELDS = [
    field.name
    for field in dataclasses.fields(BusStatistics)
    if field.name not in ("stages", "free_threaded", "schedules", "outbox_pending")
]
#: Stage figures that are not summed across processes: the names, and what does not add
#: up (the highest of the processes' is kept).
_NOT_SUMMED = {"name", "topic", "group", "latency_p50", "latency_p99", "wait_p99"}
_NOT_SUMMED |= {"saturation", "shedding", "limit", "capacity"}
#: Settings of the group, the same in every process (the first non-None reading is kept).
_NOT_SUMMED |= {"ordering", "max_in_flight", "partitions"}
_SUMMED = _STAGE_FIELDS - _NOT_SUMMED


@runtime_checkable
class Heartbeats(Protocol):
    """A transport that keeps each process's heartbeat record in its broker, under its
    prefix (Redis, NATS; PostgreSQL: in its schema), for :meth:`Bus.cluster_statistics`."""

    async def beat(self, instance: str, record: bytes) -> None:
        """Write ``record`` as process ``instance``'s latest heartbeat."""

    async def beats(self) -> list[bytes]:
        """Every process's latest heartbeat record written in the last
        :data:`FORGET_AFTER` seconds (older ones may be dropped meanwhile)."""

    async def forget(self, instance: str) -> None:
        """Delete process ``instance``'s record (its bus closed)."""


@dataclass(frozen=True, slots=True)
class ProcessStatistics:
    """One process of the deployment, as its latest heartbeat said.

    :ivar instance: a random id the process's bus drew when it started.
    :ivar host: the host name it runs on.
    :ivar pid: its process id.
    :ivar bus: its bus's name.
    :ivar started: when its bus started (epoch seconds).
    :ivar seen: when its latest heartbeat was written (epoch seconds, its clock).
    :ivar interval: seconds between its heartbeats.
    :ivar stale: whether nothing was heard from it for three intervals.
    :ivar this_process: whether it is the process that made this view.
    :ivar statistics: its bus's statistics at that heartbeat.
    """

    instance: str
    host: str
    pid: int
    bus: str
    started: float
    seen: float
    interval: float
    stale: bool
    this_process: bool
    statistics: BusStatistics

    @property
    def name(self) -> str:
        """``"host:pid"``: how the dashboard names the process."""
        return f"{self.host}:{self.pid}"


@dataclass(frozen=True, slots=True)
class ClusterStatistics:
    """Every process of the deployment and their sums (:meth:`Bus.cluster_statistics`).

    :ivar processes: one per process heard from, this one first, then by host and pid.
    :ivar totals: the processes' statistics summed, stale ones included (what they did
        happened): each ledger column, and per stage name its columns (latencies and
        other figures that do not add up are the highest of the processes'; so is
        ``outbox_pending``, since replicas sharing an outbox count the same rows).
    """

    processes: tuple[ProcessStatistics, ...]
    totals: BusStatistics

    @property
    def live(self) -> tuple[ProcessStatistics, ...]:
        """The processes that are not stale."""
        return tuple(process for process in self.processes if not process.stale)


def _stage_from(data: dict[str, Any]) -> StageStatistics:
    return StageStatistics(**{key: value for key, value in data.items() if key in _STAGE_FIELDS})


def _encode(process: ProcessStatistics) -> bytes:
    statistics = dataclasses.asdict(process.statistics)
    del statistics["schedules"]  # (each replica runs the same: not a figure to sum)
    record = {
        "v": _VERSION,
        "instance": process.instance,
        "host": process.host,
        "pid": process.pid,
        "bus": process.bus,
        "started": process.started,
        "seen": process.seen,
        "interval": process.interval,
        "statistics": statistics,
    }
    return json.dumps(record, separators=(",", ":"), allow_nan=False).encode()


def _decode(raw: bytes, now: float, mine: str) -> ProcessStatistics | None:
    """A heartbeat record; ``None`` (logged) for one this version cannot read."""
    try:
        record = json.loads(raw)
        if not isinstance(record, dict) or record.get("v") != _VERSION:
            raise ValueError("not a heartbeat record of this version")
        data = record["statistics"]
        stages = tuple(_stage_from(stage) for stage in data.get("stages", ()))
        totals = {key: data[key] for key in _TOTAL_FIELDS if key in data}
        pending = data.get("outbox_pending")
        statistics = BusStatistics(
            stages=stages,
            free_threaded=bool(data.get("free_threaded")),
            outbox_pending=None if pending is None else int(pending),
            **totals,
        )
        seen, interval = float(record["seen"]), float(record["interval"])
        instance = str(record["instance"])
        return ProcessStatistics(
            instance=instance,
            host=str(record["host"]),
            pid=int(record["pid"]),
            bus=str(record["bus"]),
            started=float(record["started"]),
            seen=seen,
            interval=interval,
            stale=now - seen > _MISSED * interval,
            this_process=instance == mine,
            statistics=statistics,
        )
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as error:
        logger.debug("skipped a heartbeat record that cannot be read: %s", error)
        return None


def sum_statistics(processes: Iterable[ProcessStatistics]) -> BusStatistics:
    """The processes' statistics summed (see :attr:`ClusterStatistics.totals`)."""
    totals: dict[str, Any] = dict.fromkeys(_TOTAL_FIELDS, 0)
    stages: dict[str, dict[str, Any]] = {}
    free_threaded = False
    # The outbox's table is shared by the replicas on its schema, each counting the same
    # rows: the highest reading, not the sum; of the live processes when any reads it
    # (a stale one's last count may be minutes old).
    pending: list[int] = []
    live_pending: list[int] = []
    for process in processes:
        statistics = process.statistics
        free_threaded = free_threaded or statistics.free_threaded
        if statistics.outbox_pending is not None:
            pending.append(statistics.outbox_pending)
            if not process.stale:
                live_pending.append(statistics.outbox_pending)
        for key in _TOTAL_FIELDS:
            totals[key] += getattr(statistics, key)
        for stage in statistics.stages:
            figures = dataclasses.asdict(stage)
            summed = stages.get(stage.name)
            if summed is None:
                stages[stage.name] = figures
                continue
            for key, value in figures.items():
                if key in _SUMMED:
                    summed[key] += value
                elif value is None or summed[key] is None:
                    summed[key] = value if summed[key] is None else summed[key]
                elif isinstance(value, str):
                    continue
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    summed[key] = max(summed[key], value)
                elif isinstance(value, bool):
                    summed[key] = summed[key] or value
    return BusStatistics(
        stages=tuple(_stage_from(stages[name]) for name in sorted(stages)),
        free_threaded=free_threaded,
        outbox_pending=max(live_pending or pending, default=None),
        **totals,
    )


class ClusterWatch:
    """This process's heartbeat, and the view of every process's.

    :param bus_name: the bus's name (in the record).
    :param statistics: reads this bus's statistics (on the event loop).
    :param interval: seconds between two heartbeats.
    :param store: the transport, as :class:`Heartbeats` (``None``: this process alone).
    :param cleanup: the scope to delete this process's record in at the close: shielded,
        bounded by the close's deadline (the mode's ``cleanup_scope``).
    """

    def __init__(
        self,
        bus_name: str,
        statistics: Callable[[], BusStatistics],
        interval: float,
        store: Heartbeats | None,
        cleanup: Callable[[], AbstractContextManager[anyio.CancelScope]] = anyio.CancelScope,
    ) -> None:
        self.bus_name = bus_name
        self.statistics = statistics
        self.interval = interval
        self.store = store
        self.cleanup = cleanup
        self.instance = secrets.token_hex(8)
        self.host = socket.gethostname()
        self.started = time.time()
        #: The other processes as the latest reading found them.
        self.others: list[ProcessStatistics] = []
        self._failing = False

    def this_process(self) -> ProcessStatistics:
        """This process, now."""
        return ProcessStatistics(
            instance=self.instance,
            host=self.host,
            pid=os.getpid(),
            bus=self.bus_name,
            started=self.started,
            seen=time.time(),
            interval=self.interval,
            stale=False,
            this_process=True,
            statistics=self.statistics(),
        )

    def view(self) -> ClusterStatistics:
        """This process now, and the others as last read (staleness judged now)."""
        now = time.time()
        others = [
            dataclasses.replace(process, stale=now - process.seen > _MISSED * process.interval)
            for process in self.others
        ]
        processes = (self.this_process(), *sorted(others, key=lambda p: (p.host, p.pid)))
        return ClusterStatistics(processes=processes, totals=sum_statistics(processes))

    async def beat_once(self) -> None:
        """Write this process's heartbeat and read everyone's (a failure is logged)."""
        store = self.store
        if store is None:
            return
        try:
            await store.beat(self.instance, _encode(self.this_process()))
            records = await store.beats()
        except Exception as error:  # the broker is away: the next round tries again
            if not self._failing:
                logger.warning("heartbeat through the broker failed (retrying): %s", error)
            self._failing = True
            return
        if self._failing:
            logger.info("heartbeats through the broker work again")
        self._failing = False
        now = time.time()
        others = []
        for raw in records:
            process = _decode(raw, now, self.instance)
            if process is not None and not process.this_process:
                others.append(process)
        self.others = others

    async def run(self) -> None:
        """Beat every ``interval`` until cancelled; then delete this process's record
        (within the close's deadline, one second at most: else it expires on its own)."""
        try:
            while True:
                await self.beat_once()
                await anyio.sleep(self.interval)
        finally:
            store = self.store
            if store is not None:
                with self.cleanup(), anyio.move_on_after(1.0):
                    try:
                        await store.forget(self.instance)
                    except Exception as error:  # it expires on its own
                        logger.debug("could not delete this process's heartbeat: %s", error)


def check_heartbeat(value: float | None) -> float | None:
    """``value`` as the bus's ``heartbeat``: ``None`` or finite seconds ``> 0``, at most
    a minute (a record is forgotten :data:`FORGET_AFTER` seconds after its last write)."""
    return None if value is None else check_seconds(value, "Bus: heartbeat", maximum=60.0)
