"""``bus.cluster_statistics()`` in memory: this process alone, its figures summed."""

from __future__ import annotations

import dataclasses
import os
import socket

import anyio
import pytest

from asyncbus import Bus, ClusterStatistics, ConfigurationError

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
