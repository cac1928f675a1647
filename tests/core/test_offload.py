"""Sync handlers on the bus-wide worker pool: threads, processes, inline, thread safety."""

from __future__ import annotations

import importlib
import itertools
import os
import subprocess
import sys
import sysconfig
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
from anyio.abc import TaskStatus

import asyncbus
from asyncbus import Bus, DeadLetterReason, Envelope, Receipt

pytestmark = pytest.mark.anyio

# A process worker imports the handler by module name. The tests run with
# --import-mode=importlib, which puts no test directory on sys.path, so put this one
# there: anyio hands the parent's sys.path to each worker process it starts.
_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)
process_handlers = importlib.import_module("_process_handlers")
cancel_once_the_slot_is_taken = importlib.import_module("_cancelling").cancel_once_the_slot_is_taken


class ConcurrencyGauge:
    """Counts the calls running at once, across threads, and remembers the most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.most = 0
        self.calls = 0

    def __enter__(self) -> None:
        with self._lock:
            self.current += 1
            self.calls += 1
            self.most = max(self.most, self.current)

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self.current -= 1


def run_threads(count: int, target: Any) -> None:
    """Run ``target(k)`` on ``count`` threads at once and join them all."""
    threads = [threading.Thread(target=target, args=(k,), daemon=True) for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not any(thread.is_alive() for thread in threads)


async def test_sync_handlers_never_run_on_the_event_loop_thread() -> None:
    loop_thread = threading.get_ident()
    seen: dict[str, list[int]] = {"default": [], "thread": []}
    bus = Bus(workers=2)

    @bus.subscribe("work", group="default", concurrency=2)
    def by_default(n: int) -> None:
        seen["default"].append(threading.get_ident())

    @bus.subscribe("work", group="thread", concurrency=2, offload="thread")
    def on_threads(n: int) -> None:
        seen["thread"].append(threading.get_ident())

    with anyio.fail_after(10):
        async with bus:
            for n in range(20):
                await bus.publish("work", n)
            await bus.drain()

            assert len(seen["default"]) == len(seen["thread"]) == 20
            assert loop_thread not in seen["default"]
            assert loop_thread not in seen["thread"]
            assert bus.statistics().stage("work@default").acked == 20
            assert bus.statistics().stage("work@thread").acked == 20


async def test_a_sync_handler_blocking_for_300_ms_does_not_stall_the_event_loop() -> None:
    window: dict[str, float] = {}
    ticks: list[float] = []
    bus = Bus(workers=2)

    @bus.subscribe("block")
    def block(n: int) -> None:
        window["start"] = time.monotonic()
        time.sleep(0.3)
        window["end"] = time.monotonic()

    async def tick(*, task_status: TaskStatus[None]) -> None:
        ticks.append(time.monotonic())
        task_status.started()
        while True:
            await anyio.sleep(0.01)
            ticks.append(time.monotonic())

    with anyio.fail_after(10):
        async with bus, anyio.create_task_group() as ticker:
            await ticker.start(tick)
            await bus.publish("block", 1)
            await bus.drain()
            ticker.cancel_scope.cancel()

    assert ticks[0] < window["start"]
    during = [t for t in ticks if t <= window["end"]]
    gaps = [later - earlier for earlier, later in itertools.pairwise(during)]
    gaps.append(window["end"] - during[-1])
    # the ticker kept ticking every ~10 ms all through the 300 ms block
    assert max(gaps) < 0.15


async def test_two_stages_of_concurrency_4_on_two_workers_run_at_most_two_handlers() -> None:
    gauge = ConcurrencyGauge()
    bus = Bus(workers=2)

    def hold(n: int) -> None:
        with gauge:
            time.sleep(0.05)

    bus.subscribe("first", hold, group="first", concurrency=4)
    bus.subscribe("second", hold, group="second", concurrency=4, offload="thread")

    with anyio.fail_after(20):
        async with bus:
            for n in range(8):
                await bus.publish("first", n)
                await bus.publish("second", n)
            await bus.drain()

            assert gauge.calls == 16
            assert gauge.most == 2
            for name in ("first@first", "second@second"):
                stats = bus.statistics().stage(name)
                assert (stats.concurrency, stats.published, stats.acked) == (4, 8, 8)
                assert (stats.dead_lettered, stats.depth, stats.in_flight) == (0, 0, 0)


async def test_inline_offload_runs_the_sync_handler_on_the_event_loop_thread() -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []
    bus = Bus()

    @bus.subscribe("cheap", offload="inline", concurrency=2)
    def cheap(n: int) -> None:
        seen.append(threading.get_ident())

    with anyio.fail_after(10):
        async with bus:
            for n in range(5):
                await bus.publish("cheap", n)
            await bus.drain()

    assert seen == [loop_thread] * 5


async def test_process_offload_returns_results_through_a_routing_slip() -> None:
    # anyio.to_process works on trio too (checked on trio 0.35): every backend runs it.
    arrived: list[Envelope] = []
    bus = Bus(workers=2)
    bus.subscribe("proc.square", process_handlers.square, offload="process")
    bus.subscribe("proc.tag", process_handlers.tag_with_pid, offload="process")

    @bus.subscribe("proc.sink")
    async def sink(env: Envelope) -> None:
        arrived.append(env)

    with anyio.fail_after(30):
        async with bus:
            pid, value = await bus.request("proc.square", 7, slip=["proc.tag"])
            receipt = await bus.publish("proc.square", 12, slip=["proc.sink"])
            await bus.drain()

            assert (value, pid != os.getpid()) == (49, True)
            assert [env.payload for env in arrived] == [144]
            assert arrived[0].correlation_id == receipt.id
            assert arrived[0].causation_id == receipt.id
            stats = bus.statistics()
            assert stats.stage("proc.square@_process_handlers:square").acked == 2
            assert stats.stage("proc.tag@_process_handlers:tag_with_pid").acked == 1
            assert (stats.dead_lettered, len(bus.dead_letters)) == (0, 0)


@pytest.mark.parametrize(
    "payload",
    [pytest.param(threading.Lock(), id="lock"), pytest.param(lambda: None, id="lambda")],
)
async def test_an_unpicklable_payload_for_process_offload_is_dead_lettered_rejected(
    payload: object,
) -> None:
    sunk: list[int] = []
    bus = Bus(workers=1)
    bus.subscribe("proc.square", process_handlers.square, offload="process", group="square")

    @bus.subscribe("proc.sink")
    async def sink(n: int) -> None:
        sunk.append(n)

    with anyio.fail_after(30):
        async with bus:
            bad = await bus.publish("proc.square", payload, slip=["proc.sink"])
            await bus.drain()
            # the stage is not broken by it
            await bus.publish("proc.square", 3, slip=["proc.sink"])
            await bus.drain()

            [dead] = bus.dead_letters.list()
            assert (dead.envelope.id, dead.reason, dead.stage, dead.attempts) == (
                bad.id,
                DeadLetterReason.REJECTED,
                "proc.square@square",
                1,
            )
            assert dead.error is not None
            assert "pickl" in dead.error.lower()
            assert sunk == [9]
            stats = bus.statistics().stage("proc.square@square")
            assert (stats.published, stats.acked, stats.dead_lettered, stats.retried) == (
                2,
                1,
                1,
                0,
            )


async def test_process_offload_hands_an_envelope_annotated_handler_its_envelope() -> None:
    # the envelope, headers included, is pickled to the worker process and back
    bus = Bus(workers=1)
    bus.subscribe("proc.env", process_handlers.describe_envelope, offload="process")

    with anyio.fail_after(30):
        async with bus:
            reply = await bus.request("proc.env", 5, headers={"k": "v"})

    assert reply == ("proc.env", 5, {"k": "v"})


async def test_an_unpicklable_handler_for_process_offload_is_dead_lettered_rejected() -> None:
    bus = Bus(workers=1)

    def nested(n: int) -> int:  # a local function cannot be pickled by reference
        return n

    bus.subscribe("proc.nested", nested, group="nested", offload="process")

    with anyio.fail_after(30):
        async with bus:
            receipt = await bus.publish("proc.nested", 1)
            await bus.drain()

            [dead] = bus.dead_letters.list()
            assert (dead.envelope.id, dead.reason) == (receipt.id, DeadLetterReason.REJECTED)
            assert dead.error is not None
            assert "pickl" in dead.error.lower()
            stats = bus.statistics().stage("proc.nested@nested")
            assert (stats.published, stats.acked, stats.dead_lettered) == (1, 0, 1)


async def test_publish_threadsafe_from_eight_threads_into_an_offloaded_stage_is_exact() -> None:
    lock = threading.Lock()
    handled: list[tuple[int, int]] = []
    bus = Bus(workers=2)

    @bus.subscribe("work", group="pool", concurrency=4)
    def consume(pair: tuple[int, int]) -> None:
        with lock:
            handled.append(pair)

    def publish_from_threads() -> list[Receipt]:
        futures: list[list[Future[Receipt]]] = [[] for _ in range(8)]

        def produce(k: int) -> None:
            for n in range(1000):
                futures[k].append(bus.publish_threadsafe("work", (k, n)))

        run_threads(8, produce)
        return [future.result(timeout=20) for mine in futures for future in mine]

    with anyio.fail_after(40):
        async with bus:
            receipts = await anyio.to_thread.run_sync(publish_from_threads, abandon_on_cancel=True)
            await bus.drain()

            assert len(receipts) == 8000
            assert len({receipt.id for receipt in receipts}) == 8000
            assert {receipt.accepted for receipt in receipts} == {("work@pool",)}
            assert len(handled) == 8000
            assert sorted(handled) == [(k, n) for k in range(8) for n in range(1000)]
            stats = bus.statistics().stage("work@pool")
            assert (stats.published, stats.acked, stats.failed, stats.dead_lettered) == (
                8000,
                8000,
                0,
                0,
            )
            assert (stats.rejected, stats.dropped, stats.depth, stats.in_flight) == (0, 0, 0, 0)
            assert len(bus.dead_letters) == 0


async def test_publish_threadsafe_works_from_inside_an_offloaded_sync_handler() -> None:
    loop_thread = threading.get_ident()
    receipts: list[Receipt] = []
    threads: list[int] = []
    sunk: list[int] = []
    bus = Bus(workers=2)

    @bus.subscribe("first", group="forward", concurrency=2, offload="thread")
    def forward(n: int) -> None:
        threads.append(threading.get_ident())
        # waiting on the future blocks this worker thread, never the loop
        receipts.append(bus.publish_threadsafe("second", n * 10).result(timeout=10))

    @bus.subscribe("second", group="sink")
    async def sink(n: int) -> None:
        sunk.append(n)

    with anyio.fail_after(20):
        async with bus:
            for n in range(10):
                await bus.publish("first", n)
            await bus.drain()

            assert loop_thread not in threads
            assert sorted(sunk) == [n * 10 for n in range(10)]
            assert [receipt.accepted for receipt in receipts] == [("second@sink",)] * 10
            stats = bus.statistics()
            assert (stats.stage("first@forward").acked, stats.stage("second@sink").acked) == (
                10,
                10,
            )
            assert len(bus.dead_letters) == 0


async def test_statistics_report_whether_the_build_is_free_threaded() -> None:
    expected = (
        bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
        and not getattr(sys, "_is_gil_enabled", lambda: True)()
    )
    async with Bus() as bus:
        assert bus.statistics().free_threaded is asyncbus.FREE_THREADED
    assert asyncbus.FREE_THREADED is expected


async def test_a_timed_out_thread_keeps_its_worker_slot_until_it_returns() -> None:
    # A timeout abandons the attempt; the thread runs to its end holding
    # its slot (anyio's own limiter= frees the slot at once on asyncio: regression guard).
    gauge = ConcurrencyGauge()
    idle = threading.Condition()
    bus = Bus(workers=1)

    def slow(n: int) -> None:
        with gauge:
            time.sleep(0.3)
        with idle:
            idle.notify_all()

    def wait_until_idle() -> bool:
        with idle:
            return idle.wait_for(lambda: gauge.current == 0, timeout=10)

    bus.subscribe("slow", slow, group="slow", timeout=0.05)
    with anyio.fail_after(20):
        async with bus:
            for n in range(3):
                await bus.publish("slow", n)
            await bus.drain()
            # abandoned threads still run: let them end before the loop does
            assert await anyio.to_thread.run_sync(wait_until_idle)

            reasons = [dead.reason for dead in bus.dead_letters.list()]
            assert reasons == [DeadLetterReason.TIMEOUT] * 3
            assert gauge.most == 1


async def test_thread_stages_shorten_the_gil_switch_interval_while_the_bus_runs() -> None:
    before = sys.getswitchinterval()
    bus = Bus(switch_interval=0.0005)

    @bus.subscribe("work", group="g")
    def work(n: int) -> int:
        return n

    async with bus:
        if asyncbus.FREE_THREADED:
            assert sys.getswitchinterval() == before
        else:
            assert sys.getswitchinterval() == min(before, 0.0005)
    assert sys.getswitchinterval() == before


async def test_a_default_bus_changes_nothing_of_the_process() -> None:
    """The switch interval and the worker processes' niceness are settings, off by default."""
    before = sys.getswitchinterval()
    bus = Bus()
    bus.subscribe("work", lambda n: n, group="threads")
    bus.subscribe("nice", process_handlers.niceness, offload="process", group="processes")
    with anyio.fail_after(30):
        async with bus:
            assert sys.getswitchinterval() == before
            await bus.publish("work", 1)
            result = await bus.request("nice", None)
            assert sys.getswitchinterval() == before
    assert result == os.nice(0)
    assert sys.getswitchinterval() == before


def test_process_settings_are_checked() -> None:
    with pytest.raises(asyncbus.ConfigurationError):
        Bus(switch_interval=0)
    with pytest.raises(asyncbus.ConfigurationError):
        Bus(worker_niceness=0)
    with pytest.raises(asyncbus.ConfigurationError):
        Bus(worker_niceness=1.5)  # type: ignore[arg-type]


async def test_a_cancellation_before_the_thread_starts_hands_the_slot_back(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    ran: list[int] = []
    probed: list[int] = []
    bus = Bus(workers=1)

    @bus.subscribe("work", group="g", middleware=[cancel_once_the_slot_is_taken])
    def work(n: int) -> None:
        ran.append(n)

    @bus.subscribe("probe", group="probe")
    def probe(n: int) -> None:
        probed.append(n)

    with anyio.fail_after(20):
        async with bus:
            for n in range(20):
                await bus.publish("work", n)
            await bus.drain(timeout=10)
            # the one slot is free: a sync handler still runs
            await bus.publish("probe", 1)
            await bus.drain(timeout=10)
    assert probed == [1]
    if anyio_backend[0] == "asyncio":
        # (trio may run the two tasks of that yield in either order: some threads start)
        assert ran == []  # each attempt was given up before its thread started


async def test_many_timeouts_on_one_worker_never_leak_its_slot() -> None:
    gauge = ConcurrencyGauge()
    probed: list[int] = []
    bus = Bus(workers=1)

    @bus.subscribe("slow", group="slow", concurrency=4, timeout=0.002)
    def slow(n: int) -> None:
        with gauge:
            time.sleep(0.005)

    @bus.subscribe("probe", group="probe")
    def probe(n: int) -> None:
        probed.append(n)

    with anyio.fail_after(40):
        async with bus:
            for n in range(200):
                await bus.publish("slow", n)
            await bus.drain(timeout=30)
            await bus.publish("probe", 1)
            await bus.drain(timeout=10)
            stats = bus.statistics().stage("slow@slow")
            assert stats.acked + stats.dead_lettered == 200
    assert probed == [1]
    assert gauge.most == 1  # abandoned threads kept their slot while they ran


async def test_a_pool_larger_than_anyios_default_runs_every_worker_at_once() -> None:
    workers = 50  # anyio's process-wide default thread limiter has 40 tokens
    barrier = threading.Barrier(workers, timeout=15)
    bus = Bus(workers=workers)

    @bus.subscribe("wide", group="g", concurrency=workers)
    def wide(n: int) -> None:
        barrier.wait()  # passes only once all of them run at the same time

    with anyio.fail_after(40):
        async with bus:
            for n in range(workers):
                await bus.publish("wide", n)
            await bus.drain(timeout=30)
            stats = bus.statistics().stage("wide@g")
            assert (stats.acked, stats.dead_lettered) == (workers, 0)


_ABANDONED_THREAD_SCRIPT = """
import sys, threading, time
from asyncbus import Bus

started = threading.Event()


async def main():
    bus = Bus(workers=1)

    @bus.subscribe("slow", group="g", timeout=0.5)  # time for the thread to start, when busy
    def slow(_):
        started.set()
        time.sleep(2.0)  # still running when the bus has closed

    async with bus:
        await bus.publish("slow")
        await bus.drain(timeout=10)  # the attempt timed out: dead-lettered
    assert started.is_set()
    print("closed", flush=True)


backend = sys.argv[1]
if backend == "trio":
    import trio

    trio.run(main)
else:
    import asyncio

    if backend == "uvloop":
        import uvloop

        loop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    loop.run_until_complete(main())
    # The loop is stopped but, as some hosts leave it, never closed.
"""


@pytest.mark.timeout(90)
def test_an_abandoned_worker_thread_never_blocks_interpreter_exit(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    name, options = anyio_backend
    backend = "uvloop" if options.get("use_uvloop") else name
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-c", _ABANDONED_THREAD_SCRIPT, backend],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the process did not exit: a worker thread blocked interpreter exit")
    assert (done.returncode, done.stdout.strip()) == (0, "closed"), done.stderr
    assert time.monotonic() - started < 45
