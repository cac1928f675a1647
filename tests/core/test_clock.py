"""The clock seam: every duration the bus decides on reads the event loop's clock.

These tests run on trio with ``MockClock(autojump_threshold=0)``: whenever every task
waits, the clock jumps to the next deadline, so an hour passes at once and exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, PublishTimeout, Retry
from asyncbus.middleware import deduplicate
from asyncbus.middleware.deduplicate import MemoryDedupStore

pytestmark = [pytest.mark.anyio, pytest.mark.backends("trio-mock-clock")]


async def test_dead_letters_expire_after_their_ttl_on_the_loop_clock() -> None:
    with anyio.fail_after(7200):
        async with Bus(dead_letter_ttl=3600) as bus:
            first = await bus.publish("nobody.home", 1)
            await anyio.sleep(1800)
            second = await bus.publish("nobody.home", 2)
            await anyio.sleep(1799)
            assert [d.envelope.id for d in bus.dead_letters.list()] == [first.id, second.id]
            await anyio.sleep(2)
            assert [d.envelope.id for d in bus.dead_letters.list()] == [second.id]
        # a closed bus keeps expiring its dead letters on the same clock
        await anyio.sleep(1800)
        assert len(bus.dead_letters) == 0


@pytest.mark.parametrize("explicit_store", [False, True], ids=["stage_memory", "memory_store"])
async def test_the_deduplicate_window_is_measured_on_the_loop_clock(explicit_store: bool) -> None:
    handled: list[int] = []

    async def handle(n: int) -> None:
        handled.append(n)

    store = MemoryDedupStore() if explicit_store else None
    bus = Bus()
    bus.subscribe("t", handle, group="g", middleware=[deduplicate(window=60, store=store)])
    with anyio.fail_after(600):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await anyio.sleep(59)
            await bus.publish("t", 2, id="x")  # within the window: a duplicate
            await bus.drain()
            await anyio.sleep(2)
            await bus.publish("t", 3, id="x")  # the window has passed
            await bus.drain()
    assert handled == [1, 3]


async def test_retries_wait_their_backoff_on_the_loop_clock(
    assert_settled: Callable[[Bus], None],
) -> None:
    attempts: list[tuple[int, float]] = []
    bus = Bus()

    @bus.subscribe(
        "t",
        group="g",
        retry=Retry(max_attempts=4, backoff=10, multiplier=3, max_backoff=60, jitter=False),
    )
    async def handle(env: Envelope) -> None:
        attempts.append((env.attempt, anyio.current_time()))
        raise ValueError("again")

    with anyio.fail_after(600):
        async with bus:
            started = anyio.current_time()
            receipt = await bus.publish("t", 1)
            await bus.drain()
            assert anyio.current_time() - started == pytest.approx(100)

    assert [attempt for attempt, _ in attempts] == [1, 2, 3, 4]
    gaps = [later - earlier for (_, earlier), (_, later) in itertools.pairwise(attempts)]
    assert gaps == pytest.approx([10, 30, 60])  # the last one capped at max_backoff
    letter = bus.dead_letters.get(receipt.id)
    assert letter is not None and letter.attempts == 4
    assert_settled(bus)


async def test_handler_timeouts_and_shutdown_deadlines_run_on_the_loop_clock(
    assert_settled: Callable[[Bus], None],
) -> None:
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("slow", group="slow", timeout=30)
    async def slow(_: object) -> None:
        await anyio.sleep(3600)

    @bus.subscribe("stuck", group="stuck")
    async def stuck(_: object) -> None:
        entered.set()
        await anyio.sleep(3600)

    with anyio.fail_after(7200):
        async with bus:
            started = anyio.current_time()
            timed_out = await bus.publish("slow", 1)
            await bus.drain()
            assert anyio.current_time() - started == pytest.approx(30)
            hung = await bus.publish("stuck", 1)
            await entered.wait()
            with pytest.raises(TimeoutError):
                await bus.drain(timeout=100)
            closing = anyio.current_time()
            report = await bus.aclose(timeout=600)
            assert anyio.current_time() - closing == pytest.approx(600)

    letter = bus.dead_letters.get(timed_out.id)
    assert letter is not None and letter.reason is DeadLetterReason.TIMEOUT
    assert report.abandoned == [hung.id]
    assert_settled(bus)


async def test_a_publish_many_timeout_is_one_deadline_for_the_whole_call() -> None:
    gates = {n: anyio.Event() for n in range(-1, 30)}
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("full", group="g", capacity=2)
    async def handle(n: int) -> None:
        entered.set()
        await gates[n].wait()

    with anyio.fail_after(3600):
        async with bus:
            await bus.publish("full", -1)  # taken by the consumer, which waits
            await entered.wait()
            await bus.publish_many("full", [0, 1])  # the stage is full now
            started = anyio.current_time()
            with pytest.raises(PublishTimeout):
                await bus.publish_many("full", range(2, 12), timeout=50)
            assert anyio.current_time() - started == 50
            # A place frees up at 20: the batch takes it, then times out at its deadline.
            started = anyio.current_time()
            async with anyio.create_task_group() as group:
                group.start_soon(_set_after, 20, gates[-1])
                with pytest.raises(PublishTimeout) as caught:
                    await bus.publish_many("full", range(20, 30), timeout=50)
            assert anyio.current_time() - started == 50
            assert len(caught.value.receipts) == 1  # 20 took the place; 21 timed out
            for gate in gates.values():
                gate.set()
            await bus.drain()
    assert bus.statistics().stage("full@g").acked == 4


async def _set_after(seconds: float, event: anyio.Event) -> None:
    await anyio.sleep(seconds)
    event.set()
