"""Adaptive stages and shedding against a downstream with a knee, on trio's virtual clock.

Timing matters here, so these run on trio with ``MockClock(autojump_threshold=0)``:
virtual time jumps whenever every task waits, so seconds of load take milliseconds
and sleeps are exact.
"""

from __future__ import annotations

import itertools
import statistics

import anyio
import pytest

from asyncbus import Adaptive, Admission, Bus, DeadLetterReason, StageStatistics

pytestmark = pytest.mark.backends("trio-mock-clock")


class Downstream:
    """``slots`` parallel calls of ``service`` s; each caller beyond them adds ``extra`` s."""

    def __init__(self, slots: int, service: float, extra: float) -> None:
        self.slots, self.service, self.extra = slots, service, extra
        self.inside = 0

    async def call(self, _: object = None) -> None:
        self.inside += 1
        try:
            await anyio.sleep(self.service + max(0, self.inside - self.slots) * self.extra)
        finally:
            self.inside -= 1


def balanced(stage: StageStatistics) -> bool:
    return stage.published == (
        stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
    )


async def watch(bus: Bus, name: str, samples: list[StageStatistics], stop: anyio.Event) -> None:
    while not stop.is_set():
        samples.append(bus.statistics().stage(name))
        with anyio.move_on_after(0.01):
            await stop.wait()


@pytest.mark.anyio
async def test_an_adaptive_stage_finds_the_knee_and_the_ledger_balances_throughout() -> None:
    downstream = Downstream(slots=4, service=0.01, extra=0.01)
    bus = Bus()
    bus.subscribe("work", downstream.call, group="w", concurrency=Adaptive(min=1, max=32))
    samples: list[StageStatistics] = []
    stop = anyio.Event()
    with anyio.fail_after(600):  # virtual seconds
        async with bus, anyio.create_task_group() as group:
            group.start_soon(watch, bus, "work@w", samples, stop)
            for n in range(3000):
                await bus.publish("work", n)
            await bus.drain()
            stop.set()
    assert all(balanced(stage) for stage in samples)
    limits = [stage.limit for stage in samples]
    assert max(limits) > 4  # it probed past the knee ...
    assert any(later < earlier for earlier, later in itertools.pairwise(limits))  # backed off
    busy = limits[len(limits) // 4 : -len(limits) // 4]
    assert statistics.median(busy) in (4, 5)  # the knee: 4 slots
    stage = bus.statistics().stage("work@w")
    assert (stage.published, stage.acked, stage.dead_lettered) == (3000, 3000, 0)
    assert stage.abandoned == 0


@pytest.mark.anyio
async def test_a_burst_is_shed_as_overload_and_shedding_stops_after_it() -> None:
    downstream = Downstream(slots=4, service=0.01, extra=0.01)  # 400 calls a second
    bus = Bus()
    target = Admission(target_wait=0.05, interval=0.05)
    bus.subscribe("work", downstream.call, group="w", concurrency=4, admission=target)
    samples: list[StageStatistics] = []
    stop = anyio.Event()
    waits: list[float] = []
    with anyio.fail_after(600):
        async with bus, anyio.create_task_group() as group:
            group.start_soon(watch, bus, "work@w", samples, stop)
            for rate, seconds in ((1200, 2.0), (200, 1.0)):  # 3x, then 0.5x
                for n in range(int(rate * seconds)):
                    await bus.publish("work", n)
                    await anyio.sleep(1 / rate)
            await bus.drain()
            stop.set()
            waits.append(bus.statistics().stage("work@w").wait_p99)
    stage = bus.statistics().stage("work@w")
    assert all(balanced(sample) for sample in samples)
    assert any(sample.shedding for sample in samples)
    assert not samples[-1].shedding  # the 0.5x phase: back to first-in first-out
    dead = bus.dead_letters.list(reason=DeadLetterReason.OVERLOAD)
    assert len(dead) == stage.shed == stage.dead_lettered
    assert stage.published == 2600 == stage.acked + stage.shed
    # 1,600 more arrived than the downstream could take; about that many were shed.
    assert 1400 <= stage.shed <= 1700
    assert waits[0] <= 0.1  # nothing waited much longer than the target, then it was shed
