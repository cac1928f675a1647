"""Shedding, priorities and adaptive stages on a running bus, with the controllers' clock faked.

The controllers read ``asyncbus._control.default_clock``; these tests replace it with
a clock they move by hand, so each step is pinned on asyncio, uvloop and trio alike.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from asyncbus import (
    HEADER_PRIORITY,
    Adaptive,
    Admission,
    Bus,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    MemoryTransport,
    Priority,
    Retry,
    StageStatistics,
    _control,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(_control, "default_clock", fake)
    return fake


def balanced(stage: StageStatistics) -> bool:
    return stage.published == (
        stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
    )


async def settled(bus: Bus, name: str, acked: int) -> StageStatistics:
    """Let the consumers run until ``acked`` envelopes are acked, each slot of the limit
    holds an envelope (or none is left) and the consumers alive are exactly the limit."""
    for _ in range(200):
        stage = bus.statistics().stage(name)
        if (
            stage.acked == acked
            and stage.concurrency == stage.limit
            and stage.in_flight == min(stage.limit, stage.in_flight + stage.depth)
        ):
            return stage
        await anyio.lowlevel.checkpoint()
    raise AssertionError(f"the stage never settled: {stage}")


class Gates:
    """Handler ``n`` announces it started, then waits until the test releases it."""

    def __init__(self, count: int) -> None:
        self.started = {n: anyio.Event() for n in range(1, count + 1)}
        self.release = {n: anyio.Event() for n in range(1, count + 1)}
        self.order: list[int] = []

    async def handle(self, n: int) -> None:
        self.order.append(n)
        self.started[n].set()
        await self.release[n].wait()


@pytest.mark.anyio
async def test_stale_envelopes_are_shed_as_overload_and_the_newest_is_served(
    clock: FakeClock,
) -> None:
    gates = Gates(7)
    bus = Bus()
    bus.subscribe(
        "work", gates.handle, group="w", admission=Admission(target_wait=1.0, interval=1.0)
    )
    with anyio.fail_after(10):
        async with bus:
            for n in range(1, 7):
                await bus.publish("work", n)  # all admitted at t=0
            await gates.started[1].wait()
            clock.now = 1.5
            gates.release[1].set()
            # The oldest has waited 1.5 s, above 1 s for 0.5 s: not yet, first-in first-out.
            await gates.started[2].wait()
            stage = bus.statistics().stage("work@w")
            assert (stage.shedding, stage.shed, stage.depth) == (False, 0, 4)
            clock.now = 3.0
            await bus.publish("work", 7)  # fresh: admitted at t=3
            gates.release[2].set()
            # Above the target for a whole interval: shed what waited > 1 s, newest first.
            await gates.started[7].wait()
            stage = bus.statistics().stage("work@w")
            assert (stage.shedding, stage.shed, stage.dead_lettered, stage.depth) == (
                True,
                4,
                4,
                0,
            )
            assert balanced(stage)
            dead = bus.dead_letters.list(reason=DeadLetterReason.OVERLOAD)
            assert [entry.envelope.payload for entry in dead] == [3, 4, 5, 6]
            assert {(entry.stage, entry.attempts, entry.error) for entry in dead} == {
                ("work@w", 0, None)
            }
            gates.release[7].set()
            await bus.drain()
            await anyio.wait_all_tasks_blocked()
            stage = bus.statistics().stage("work@w")
            assert not stage.shedding  # the queue emptied: back to first-in first-out
        report = await bus.aclose()
    assert gates.order == [1, 2, 7]
    assert (stage.published, stage.acked, stage.dead_lettered, stage.shed) == (7, 3, 4, 4)
    assert (report.published, report.completed, report.dead_lettered) == (7, 3, 4)
    assert report.abandoned == []


@pytest.mark.anyio
async def test_a_retried_envelope_that_is_shed_records_the_attempts_it_had(
    clock: FakeClock,
) -> None:
    failed = anyio.Event()
    queued = anyio.Event()
    holding = anyio.Event()
    release = anyio.Event()
    bus = Bus()

    async def handle(env: Envelope) -> None:
        if env.payload == "flaky":
            failed.set()
            await queued.wait()  # fails once "gate" is queued: its retry comes after it
            raise RuntimeError("not yet")
        holding.set()
        await release.wait()

    bus.subscribe(
        "work",
        handle,
        group="w",
        admission=Admission(target_wait=1.0, interval=1.0),
        retry=Retry(max_attempts=3, backoff=0),
    )
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("work", "flaky")
            await failed.wait()
            await bus.publish("work", "gate")
            queued.set()
            await holding.wait()  # the consumer holds "gate"
            await anyio.wait_all_tasks_blocked()  # "flaky" is queued again, attempt 2
            assert bus.statistics().stage("work@w").depth == 1
            clock.now = 5.0  # it has waited far past the target: shed at the next pick-up
            release.set()
            await bus.drain()
    [entry] = bus.dead_letters.list()
    assert (entry.envelope.payload, entry.reason, entry.envelope.attempt, entry.attempts) == (
        "flaky",
        DeadLetterReason.OVERLOAD,
        2,
        1,  # it was tried once before it was shed
    )
    stage = bus.statistics().stage("work@w")
    assert (stage.published, stage.acked, stage.shed, stage.retried) == (2, 1, 1, 1)


@pytest.mark.anyio
async def test_a_burst_shorter_than_the_interval_is_not_shed(clock: FakeClock) -> None:
    gates = Gates(4)
    bus = Bus()
    bus.subscribe(
        "work", gates.handle, group="w", admission=Admission(target_wait=1.0, interval=5.0)
    )
    with anyio.fail_after(10):
        async with bus:
            for n in range(1, 5):
                await bus.publish("work", n)
            for n in range(1, 5):
                await gates.started[n].wait()
                clock.now += 1.5  # every pick-up sees the oldest above the target ...
                gates.release[n].set()
            await bus.drain()  # ... but for less than the interval
    stage = bus.statistics().stage("work@w")
    assert (stage.acked, stage.shed, stage.dead_lettered) == (4, 0, 0)
    assert gates.order == [1, 2, 3, 4]


@pytest.mark.anyio
async def test_higher_priority_classes_are_served_first(clock: FakeClock) -> None:
    gates = Gates(5)
    bus = Bus()
    bus.subscribe("work", gates.handle, group="w", admission=Admission())
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("work", 1)
            await gates.started[1].wait()
            await bus.publish("work", 2, priority=Priority.LOW)
            await bus.publish("work", 3)
            await bus.publish("work", 4, priority=2)
            bus.publish_nowait("work", 5, priority=Priority.HIGH)
            for gate in gates.release.values():
                gate.set()
            await bus.drain()
    assert gates.order == [1, 4, 5, 3, 2]


@pytest.mark.anyio
async def test_priority_travels_as_a_header_and_is_validated() -> None:
    seen: list[Envelope] = []

    async def record(env: Envelope) -> None:
        seen.append(env)

    bus = Bus()
    bus.subscribe("work", record)
    async with bus:
        await bus.publish("work", 1, priority=Priority.LOW)
        await bus.publish("work", 2)
        future = await anyio.to_thread.run_sync(
            lambda: bus.publish_threadsafe("work", 3, priority=Priority.HIGH)
        )
        await anyio.to_thread.run_sync(future.result)
        for bad in (3, -1, True, "high", 1.0):
            with pytest.raises(ConfigurationError):
                await bus.publish("work", 0, priority=bad)  # type: ignore[arg-type]
        await bus.drain()
    assert [env.headers.get(HEADER_PRIORITY) for env in seen] == ["0", None, "2"]


@pytest.mark.anyio
async def test_an_adaptive_stage_adds_and_retires_consumers_between_envelopes(
    clock: FakeClock,
) -> None:
    """Every tick, all envelopes in flight finish together, ``latency`` after they began."""
    ticks = [anyio.Event()]

    async def handle(n: int) -> None:
        await ticks[-1].wait()

    bus = Bus()
    bus.subscribe("work", handle, group="w", concurrency=Adaptive(min=1, max=4))
    limits: list[int] = []
    with anyio.fail_after(20):
        async with bus:
            for n in range(150):
                await bus.publish("work", n)
            latency, acked = 0.01, 0
            for tick in range(400):
                if tick == 30:
                    latency = 1.0  # the downstream slowed down: the limit must come down
                stage = await settled(bus, "work@w", acked)
                assert balanced(stage)
                if not limits or limits[-1] != stage.limit:
                    limits.append(stage.limit)
                if not stage.depth and not stage.in_flight:
                    break
                clock.now += latency
                acked += stage.in_flight  # the envelopes this tick finishes
                ticks.append(anyio.Event())
                ticks[-2].set()
            else:
                raise AssertionError(f"not drained after 400 ticks: {stage} {limits}")
            stage = await settled(bus, "work@w", 150)
            # Retired at envelope boundaries: the consumers alive are the limit now.
            assert stage.concurrency == stage.limit == 1
    # Slow start to the max on a flat latency, then halved per slow window to the min.
    assert limits == [1, 2, 4, 2, 1]
    assert (stage.published, stage.acked, stage.dead_lettered, stage.depth) == (150, 150, 0, 0)


@pytest.mark.anyio
async def test_a_pump_over_a_broker_queues_no_more_than_the_limit() -> None:
    gates = Gates(20)
    bus = Bus(MemoryTransport(direct=False))
    bus.subscribe(
        "work",
        gates.handle,
        group="w",
        capacity=100,
        concurrency=Adaptive(min=3, max=3),
    )
    with anyio.fail_after(10):
        async with bus:
            for n in range(1, 21):
                await bus.publish("work", n)
            for n in (1, 2, 3):
                await gates.started[n].wait()
            await anyio.wait_all_tasks_blocked()
            stage = bus.statistics().stage("work@w")
            # Three with the consumers, three queued (min(capacity, limit)); 14 in the broker.
            assert (stage.in_flight, stage.depth, stage.published) == (3, 3, 6)
            for gate in gates.release.values():
                gate.set()
            await bus.drain()
    stage = bus.statistics().stage("work@w")
    assert (stage.published, stage.acked, stage.depth, stage.in_flight) == (20, 20, 0, 0)


@pytest.mark.anyio
async def test_shedding_over_a_broker_rejects_the_deliveries(clock: FakeClock) -> None:
    gates = Gates(4)
    transport = MemoryTransport(direct=False)
    bus = Bus(transport)
    bus.subscribe(
        "work",
        gates.handle,
        group="w",
        concurrency=2,
        admission=Admission(target_wait=1.0, interval=1.0),
    )
    with anyio.fail_after(10):
        async with bus:
            for n in range(1, 5):
                await bus.publish("work", n)
            await gates.started[1].wait()
            await gates.started[2].wait()
            await anyio.wait_all_tasks_blocked()  # 3 and 4 pumped in (the limit: 2) at t=0
            assert bus.statistics().stage("work@w").depth == 2
            clock.now = 1.5
            gates.release[1].set()
            await gates.started[3].wait()  # the oldest waited 1.5 s: above for 0.5 s only
            clock.now = 3.5
            gates.release[2].set()
            gates.release[3].set()
            await bus.drain()  # 4 waited 3.5 s, over the target for 2.5 s: shed
            stored = await transport.dead_letters()
    stage = bus.statistics().stage("work@w")
    assert (stage.published, stage.acked, stage.shed, stage.dead_lettered) == (4, 3, 1, 1)
    assert [(entry.envelope.payload, entry.reason) for entry in stored] == [
        (4, DeadLetterReason.OVERLOAD)
    ]
    assert [entry.envelope.payload for entry in bus.dead_letters.list()] == [4]
    assert gates.order == [1, 2, 3]


def test_subscribing_validates_adaptive_and_admission() -> None:
    async def handler(n: int) -> None: ...

    bus = Bus()
    bus.subscribe("a", handler, group="g", concurrency=Adaptive(max=8))
    bus.subscribe("a", handler, group="g", concurrency=2)  # a fixed crew beside it: fine
    with pytest.raises(ConfigurationError, match="admission"):
        bus.subscribe("a", handler, group="g", admission=Admission())
    bus.subscribe("b", handler, group="g")
    with pytest.raises(ConfigurationError, match="Adaptive"):
        bus.subscribe("b", handler, group="g", concurrency=Adaptive())
    with pytest.raises(ConfigurationError, match="admission"):
        bus.subscribe("c", handler, admission=0.05)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="concurrency"):
        bus.subscribe("c", handler, concurrency=2.5)  # type: ignore[arg-type]
    stage = bus.statistics().stage("a@g")
    assert (stage.limit, stage.concurrency, stage.shedding, stage.shed) == (3, 3, False, 0)


@pytest.mark.anyio
async def test_a_static_stage_reports_its_concurrency_as_its_limit() -> None:
    bus = Bus()

    async def handler(n: int) -> None: ...

    bus.subscribe("a", handler, group="g", concurrency=4)
    async with bus:
        await bus.publish("a", 1)
        await bus.drain()
        stage = bus.statistics().stage("a@g")
    assert (stage.limit, stage.concurrency, stage.shedding, stage.shed, stage.saturation) == (
        4,
        4,
        False,
        0,
        0.0,
    )
    names = [field.name for field in dataclasses.fields(StageStatistics)]
    # The documented fields first, then what was added, each with a default, in order.
    assert names[names.index("wait_p99") + 1 :] == [
        "abandoned",
        "capacity",
        "limit",
        "shedding",
        "shed",
        "saturation",
        "deferred",
        "ordering",
        "keys_held",
        "keys_waiting",
        "waiting_for_key",
        "max_in_flight",
        "slots_held",
        "slots_waiting",
        "partitions",
        "partitions_owned",
    ]


@pytest.mark.anyio
async def test_saturation_counts_busy_consumers_not_envelopes_waiting_for_a_retry() -> None:
    inside = anyio.Event()
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe("fails", group="g", concurrency=2, retry=Retry(max_attempts=2, backoff=60))
    async def fail(n: int) -> None:
        raise RuntimeError("later")

    @bus.subscribe("busy", group="g", concurrency=4)
    async def busy(n: int) -> None:
        inside.set()
        await release.wait()

    with anyio.fail_after(10):
        async with bus:
            for n in range(10):
                await bus.publish("fails", n)
            await bus.publish("busy", 1)
            await inside.wait()
            await anyio.wait_all_tasks_blocked()
            waiting = bus.statistics().stage("fails@g")
            # Ten envelopes wait on their retry timers (in flight); both consumers are idle.
            assert (waiting.in_flight, waiting.retried, waiting.saturation) == (10, 10, 0.0)
            one = bus.statistics().stage("busy@g")
            assert (one.in_flight, one.limit, one.saturation) == (1, 4, 0.25)
            release.set()
            report = await bus.aclose(timeout=0.1)
    assert len(report.abandoned) == 10  # still waiting for their retry


def test_the_controllers_names_import_from_asyncbus() -> None:
    import asyncbus

    for name in ("Adaptive", "Admission", "Priority", "HEADER_PRIORITY"):
        assert name in asyncbus.__all__
    assert DeadLetterReason.OVERLOAD == "overload"
    assert [int(level) for level in Priority] == [0, 1, 2]
    assert HEADER_PRIORITY == "asyncbus-priority"


@pytest.mark.anyio
async def test_a_controlled_stage_accounts_for_everything_at_shutdown(clock: FakeClock) -> None:
    gates = Gates(6)
    bus = Bus()
    bus.subscribe(
        "work",
        gates.handle,
        group="w",
        concurrency=Adaptive(min=2, max=2),
        admission=Admission(),
    )
    with anyio.fail_after(10):
        async with bus:
            ids = [
                (await bus.publish("work", n, priority=Priority.LOW if n % 2 else None)).id
                for n in range(1, 7)
            ]
            await gates.started[1].wait()
            await gates.started[2].wait()
            report = await bus.aclose(timeout=0.01)  # two held by the handlers, four queued
    assert not report.drained
    assert (report.published, report.completed, report.dead_lettered) == (6, 0, 0)
    assert sorted(report.abandoned) == sorted(ids)
    stage = bus.statistics().stage("work@w")
    assert (stage.abandoned, stage.depth, stage.in_flight) == (6, 0, 0)
    assert balanced(stage)
