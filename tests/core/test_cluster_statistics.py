"""``bus.cluster_statistics()`` in memory: this process alone, its figures summed."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import replace

import anyio
import pytest

from asyncbus import (
    Bus,
    BusStatistics,
    ClusterStatistics,
    ConfigurationError,
    ProcessStatistics,
    StageStatistics,
)
from asyncbus._cluster import _decode, _encode, sum_statistics

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_in_memory_the_deployment_is_this_process() -> None:
    bus = Bus(name="solo")

    @bus.subscribe("t", group="g")
    async def handle(n: int) -> None:
        if n == 3:
            raise RuntimeError("three")

    with anyio.fail_after(10):
        async with bus:
            for n in range(5):
                await bus.publish("t", n)
            await bus.drain()
            view = bus.cluster_statistics()
            assert isinstance(view, ClusterStatistics)
            (process,) = view.processes
            assert (process.host, process.pid, process.bus) == (
                socket.gethostname(),
                os.getpid(),
                "solo",
            )
            assert (process.this_process, process.stale) == (True, False)
            assert process.statistics == bus.statistics()
            assert view.live == view.processes
            totals = view.totals
            assert (totals.published, totals.acked, totals.dead_lettered) == (5, 4, 1)
            assert [dataclasses.astuple(s) for s in totals.stages] == [
                dataclasses.astuple(s) for s in bus.statistics().stages
            ]


@pytest.mark.parametrize("heartbeat", [0, -1, float("nan"), float("inf"), 61, "1"])
def test_a_heartbeat_that_is_not_seconds_up_to_a_minute_is_refused(heartbeat: object) -> None:
    with pytest.raises(ConfigurationError, match="heartbeat"):
        Bus(heartbeat=heartbeat)  # type: ignore[arg-type]


def _process(pid: int, outbox_pending: int | None, *, stale: bool = False) -> ProcessStatistics:
    """A process of a deployment, its ``published`` its pid."""
    statistics = BusStatistics(
        stages=(),
        published=pid,
        acked=0,
        failed=0,
        retried=0,
        dead_lettered=0,
        rejected=0,
        dropped=0,
        expired=0,
        outbox_pending=outbox_pending,
    )
    return ProcessStatistics(
        instance=f"instance-{pid}",
        host="host",
        pid=pid,
        bus="shop",
        started=0.0,
        seen=time.time(),
        interval=5.0,
        stale=stale,
        this_process=pid == 1,
        statistics=statistics,
    )


def test_the_outbox_count_of_replicas_is_their_highest_not_their_sum() -> None:
    # Replicas sharing an outbox's schema count the same rows; a bus without one says None.
    totals = sum_statistics([_process(1, 3), _process(2, None), _process(3, 5)])
    assert (totals.published, totals.outbox_pending) == (6, 5)
    assert sum_statistics([_process(1, None), _process(2, None)]).outbox_pending is None


def test_the_outbox_count_of_a_stale_replica_gives_way_to_a_live_ones() -> None:
    # A replica gone silent last counted 40 rows that a live relay has forwarded since.
    live = [_process(1, 0), _process(2, 40, stale=True)]
    assert sum_statistics(live).outbox_pending == 0
    assert sum_statistics([_process(2, 40, stale=True)]).outbox_pending == 40  # (all it knows)


def test_a_heartbeat_record_with_an_infinite_outbox_count_is_skipped() -> None:
    record = _encode(_process(2, 1))
    record = record.replace(b'"outbox_pending":1', b'"outbox_pending":Infinity')
    assert b'"outbox_pending":Infinity' in record
    assert _decode(record, time.time(), "instance-1") is None


@pytest.mark.parametrize("outbox_pending", [None, 0, 4])
def test_a_heartbeat_record_carries_the_outbox_count(outbox_pending: int | None) -> None:
    record = _encode(_process(2, outbox_pending))
    read = _decode(record, time.time(), "instance-1")
    assert read is not None
    assert (read.statistics.published, read.statistics.outbox_pending) == (2, outbox_pending)


def _with_stage(pid: int, owned: int, max_in_flight: int | None) -> ProcessStatistics:
    """A process serving ``owned`` partitions of an ordered stage split in four."""
    stage = StageStatistics(
        name="orders@g",
        topic="orders",
        group="g",
        published=10,
        acked=10,
        failed=0,
        retried=0,
        dead_lettered=0,
        rejected=0,
        dropped=0,
        expired=0,
        depth=0,
        in_flight=0,
        concurrency=4,
        latency_p50=0.0,
        latency_p99=0.0,
        wait_p99=0.0,
        ordering="key",
        max_in_flight=max_in_flight,
        partitions=4,
        partitions_owned=owned,
    )
    process = _process(pid, None)
    return replace(process, statistics=replace(process.statistics, stages=(stage,)))


def test_a_groups_settings_are_not_summed_and_its_partitions_owned_are() -> None:
    totals = sum_statistics([_with_stage(1, 3, 2), _with_stage(2, 1, None)])
    (stage,) = totals.stages
    assert (stage.ordering, stage.max_in_flight, stage.partitions) == ("key", 2, 4)
    assert (stage.published, stage.partitions_owned) == (20, 4)
