"""The bus without the GIL: every structure more than one thread touches, hammered at once.

Each test passes on any build; on a free-threaded one (``asyncbus.FREE_THREADED``, the
3.13t job of CI) the threads really run at the same time. The ``soak`` variants
(``pytest -m soak``) run the same hammering many times longer.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

import asyncbus
from asyncbus import (
    Backpressure,
    Bus,
    DeadLetterReason,
    Envelope,
    Handler,
    Receipt,
    Reject,
    Retry,
    _envelope,
    _offload,
    _runtime,
    middleware,
)
from asyncbus._dead_letters import DeadLetter
from asyncbus._logging import FailureLog

# The helpers beside this file are imported by name (see conftest.py).
cancel_once_the_slot_is_taken = importlib.import_module("_cancelling").cancel_once_the_slot_is_taken

pytestmark = pytest.mark.anyio

T = TypeVar("T")

THREADS = 16

#: The quick run (every test run) and the soak run (``pytest -m soak``) of a test.
SCALES = [
    pytest.param(1, id="quick"),
    pytest.param(20, id="soak", marks=[pytest.mark.soak, pytest.mark.timeout(900)]),
]


def in_threads(count: int, target: Callable[[int], T]) -> list[T]:
    """``target(k)`` for k in range(count), each on a thread of its own, all let go at once.

    Returns the results in order; re-raises the first exception a thread raised.
    """
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[index] = target(index)
        except BaseException as error:  # handed to the caller below
            errors.append(error)

    threads = [
        threading.Thread(target=run, args=(index,), name=f"hammer-{index}", daemon=True)
        for index in range(count)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a hammering thread hung"
    if errors:
        raise errors[0]
    return results


async def test_thousands_of_threadsafe_publishes_from_16_threads_balance_exactly(
    scale: int, assert_settled: Callable[[Bus], None]
) -> None:
    per_thread = 250 * scale
    total = THREADS * per_thread
    handled_async: list[tuple[int, int]] = []
    handled_sync: list[tuple[int, int]] = []
    bus = Bus(workers=4)

    @bus.subscribe("jobs", group="async", capacity=64)
    async def on_loop(job: tuple[int, int]) -> None:
        handled_async.append(job)

    @bus.subscribe("jobs", group="sync", capacity=64, concurrency=4)
    def in_worker(job: tuple[int, int]) -> None:
        handled_sync.append(job)  # from up to four worker threads at once

    @bus.subscribe("jobs", group="narrow", capacity=1, backpressure=Backpressure.REJECT)
    async def narrow(job: tuple[int, int]) -> None:
        await anyio.lowlevel.checkpoint()

    def publish_all(thread: int) -> list[Receipt]:
        futures = [bus.publish_threadsafe("jobs", (thread, n)) for n in range(per_thread)]
        return [future.result(timeout=120) for future in futures]

    with anyio.fail_after(60 * scale):
        async with bus:
            receipts = [
                receipt
                for receipts in await anyio.to_thread.run_sync(in_threads, THREADS, publish_all)
                for receipt in receipts
            ]
            await bus.drain()
            stats = bus.statistics()

    everything = sorted((thread, n) for thread in range(THREADS) for n in range(per_thread))
    assert len({receipt.id for receipt in receipts}) == total
    assert sorted(handled_async) == everything
    assert sorted(handled_sync) == everything
    for name in ("jobs@async", "jobs@sync"):
        assert sum(name in receipt.accepted for receipt in receipts) == total
        stage = stats.stage(name)
        assert (stage.published, stage.acked, stage.dead_lettered) == (total, total, 0)
    admitted = sum("jobs@narrow" in receipt.accepted for receipt in receipts)
    refused = sum("jobs@narrow" in receipt.rejected for receipt in receipts)
    stage = stats.stage("jobs@narrow")
    assert admitted + refused == total
    assert (stage.published, stage.acked, stage.rejected) == (admitted, admitted, refused)
    assert_settled(bus)


async def test_statistics_and_dead_letters_read_from_threads_while_sync_handlers_run_balance(
    scale: int, assert_settled: Callable[[Bus], None]
) -> None:
    total = 400 * scale
    failing = len(range(0, total, 5))
    retry = Retry(max_attempts=2, backoff=0.001, jitter=False)
    bus = Bus(workers=2)

    @bus.subscribe("work", group="cpu", concurrency=4, retry=retry)
    def crunch(n: int) -> int:
        if n % 5 == 0:
            raise ValueError(f"job {n} fails")
        return sum(range(2_000))

    stop = threading.Event()

    def read(reader: int) -> int:
        snapshots = 0
        last: dict[str, asyncbus.StageStatistics] = {}
        while not stop.is_set() or not snapshots:
            for stage in bus.statistics().stages:
                in_play = stage.depth + stage.in_flight
                assert stage.published == (
                    stage.acked + stage.dead_lettered + stage.abandoned + in_play
                ), stage
                assert 0 <= stage.latency_p50 <= stage.latency_p99, stage
                before = last.get(stage.name)
                if before is not None:  # counters only ever grow
                    assert stage.acked >= before.acked, (before, stage)
                    assert stage.dead_lettered >= before.dead_lettered, (before, stage)
                last[stage.name] = stage
            if reader % 2:
                entries = bus.dead_letters.list()
                assert all(entry.reason is DeadLetterReason.HANDLER_FAILED for entry in entries)
                if entries:
                    assert bus.dead_letters.get(entries[0].envelope.id) is not None
            snapshots += 1
        return snapshots

    with anyio.fail_after(60 * scale):
        async with bus, anyio.create_task_group() as readers:
            readers.start_soon(anyio.to_thread.run_sync, in_threads, 4, read)
            for n in range(total):
                await bus.publish("work", n)
            await bus.drain()
            stop.set()
        stats = bus.statistics().stage("work@cpu")

    assert (stats.published, stats.acked) == (total, total - failing)
    assert (stats.dead_lettered, stats.failed, stats.retried) == (failing, 2 * failing, failing)
    assert len(bus.dead_letters) == failing
    assert_settled(bus)


class Gauge:
    """Counts the handlers running at once, across threads; waits for them to end."""

    def __init__(self) -> None:
        self._idle = threading.Condition()
        self.current = 0
        self.most = 0

    def __enter__(self) -> None:
        with self._idle:
            self.current += 1
            self.most = max(self.most, self.current)

    def __exit__(self, *exc_info: object) -> None:
        with self._idle:
            self.current -= 1
            self._idle.notify_all()

    def wait_idle(self) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: self.current == 0, timeout=30)


@middleware
async def cancel_the_cancelled(env: Envelope, call_next: Handler) -> Any:
    """For a ``("cancel", n)`` job: cancel the attempt as soon as it took its pool slot."""
    if env.payload[0] != "cancel":
        return await call_next(env)
    return await cancel_once_the_slot_is_taken(call_next)(env)


async def test_offloaded_handlers_that_raise_time_out_and_are_cancelled_at_once_settle_exactly(
    scale: int, assert_settled: Callable[[Bus], None]
) -> None:
    # Enough slots that no attempt waits for one (a wait would count towards its
    # timeout): 8 consumers, each with at most one abandoned, still sleeping thread.
    workers = 24
    per_kind = 16 * scale
    kinds = ("ok", "raise", "reject", "slow", "cancel")
    gauge = Gauge()
    bus = Bus(workers=workers)

    @bus.subscribe(
        "work", group="mixed", concurrency=8, timeout=0.25, middleware=[cancel_the_cancelled]
    )
    def handle(job: tuple[str, int]) -> str:
        kind, n = job
        with gauge:
            if kind == "raise":
                raise ValueError(f"job {n}")
            if kind == "reject":
                raise Reject(f"job {n} refused")
            if kind == "slow":
                time.sleep(0.5)  # the work itself: longer than the stage's timeout
            return kind

    barrier = threading.Barrier(workers, timeout=20)

    @bus.subscribe("probe", group="probe", concurrency=workers)
    def probe(n: int) -> None:
        barrier.wait()  # passes only when every slot of the pool is free

    kind_of: dict[str, str] = {}
    with anyio.fail_after(60 * scale):
        async with bus:
            for n in range(per_kind):
                for kind in kinds:
                    receipt = await bus.publish("work", (kind, n))
                    kind_of[receipt.id] = kind
            await bus.drain()
            # Timed-out threads still run, holding their slots; once they are done,
            # every slot must be back in the pool.
            assert await anyio.to_thread.run_sync(gauge.wait_idle)
            for n in range(workers):
                await bus.publish("probe", n)
            await bus.drain()
            stats = bus.statistics()

    expected = {
        "ok": None,
        "raise": DeadLetterReason.HANDLER_FAILED,
        "reject": DeadLetterReason.REJECTED,
        "slow": DeadLetterReason.TIMEOUT,
        "cancel": None,
    }
    dead = {entry.envelope.id: entry.reason for entry in bus.dead_letters.list()}
    assert {id: dead.get(id) for id in kind_of} == {
        id: expected[kind] for id, kind in kind_of.items()
    }
    work = stats.stage("work@mixed")
    assert (work.published, work.acked, work.dead_lettered) == (
        5 * per_kind,
        2 * per_kind,
        3 * per_kind,
    )
    assert stats.stage("probe@probe").acked == workers
    assert gauge.most <= workers
    assert_settled(bus)


async def test_a_shutdown_cancelling_offloaded_handlers_mid_flight_lists_each_envelope_once(
    scale: int, assert_settled: Callable[[Bus], None]
) -> None:
    per_stage = 40 * scale
    gauge = Gauge()
    release = threading.Event()
    bus = Bus(workers=4)

    @bus.subscribe("held", group="held", concurrency=2)
    def held(n: int) -> None:
        with gauge:
            release.wait(30)

    @bus.subscribe("busy", group="busy", concurrency=2, timeout=0.05)
    def busy(n: int) -> None:
        with gauge:
            if n % 2:
                raise ValueError(f"job {n}")
            time.sleep(0.01)

    published: list[str] = []
    with anyio.fail_after(60 * scale):
        async with bus:
            for n in range(per_stage):
                published.append((await bus.publish("held", n)).id)
                published.append((await bus.publish("busy", n)).id)
            report = await bus.aclose(timeout=0.2)
        release.set()
        assert await anyio.to_thread.run_sync(gauge.wait_idle)

    dead = {entry.envelope.id for entry in bus.dead_letters.list()}
    stats = bus.statistics()
    acked = stats.acked
    assert not report.drained and report.abandoned
    assert len(report.abandoned) == len(set(report.abandoned))
    assert not dead & set(report.abandoned)
    assert len(published) == acked + len(dead) + len(report.abandoned)
    assert (report.published, report.completed, report.dead_lettered) == (
        len(published),
        acked,
        len(dead),
    )
    assert gauge.most <= 4
    assert_settled(bus)


async def test_dead_letters_read_and_purged_from_threads_as_the_loop_adds_them_balance(
    scale: int,
) -> None:
    total = 500 * scale
    stop = threading.Event()
    bus = Bus()

    @bus.subscribe("doomed", group="g", concurrency=4)
    async def doomed(n: int) -> None:
        raise Reject(f"job {n} refused")

    queue = bus.dead_letters

    def purge(_: int) -> int:
        removed = 0
        while not stop.is_set() or len(queue):
            for entry in queue.list():
                # Every thread purges what it sees: each entry is removed exactly once.
                removed += queue.purge(entry.envelope.id)
            assert sum(queue._counts().values()) <= total
        return removed

    with anyio.fail_after(60 * scale):
        async with bus, anyio.create_task_group() as purgers:

            async def purge_in_threads() -> None:
                removed.extend(await anyio.to_thread.run_sync(in_threads, 8, purge))

            removed: list[int] = []
            purgers.start_soon(purge_in_threads)
            for n in range(total):
                await bus.publish("doomed", n)
            await bus.drain()
            stop.set()
        stats = bus.statistics().stage("doomed@g")

    assert (stats.published, stats.dead_lettered) == (total, total)
    assert sum(removed) == total
    assert (len(queue), queue._counts(), queue.list()) == (0, {}, [])


def test_envelope_ids_made_on_16_threads_at_once_are_all_unique(scale: int) -> None:
    per_thread = 2_000 * scale

    def mint(thread: int) -> list[str]:
        ids = []
        for n in range(per_thread):
            if n % 3 == 0:
                ids.append(_envelope.new_id())
            elif n % 3 == 1:
                ids.append(Envelope(topic="t", payload=n).id)
            else:
                batch = _envelope.make_envelopes(
                    "t", range(5), _envelope.EMPTY_HEADERS, 1.0, None, (), None, None
                )
                assert [envelope.id for envelope in batch] == sorted(e.id for e in batch)
                ids += [envelope.id for envelope in batch]
        return ids

    minted = [id for ids in in_threads(THREADS, mint) for id in ids]
    assert len(minted) == THREADS * sum(5 if n % 3 == 2 else 1 for n in range(per_thread))
    assert len(set(minted)) == len(minted)


def test_a_batch_whose_numbers_another_thread_cut_into_still_gets_unique_sorted_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a free-threaded build can do between two numbers a batch takes: another
    # thread takes one. Pinned here with a sequence that mints that id midway, in the
    # same microsecond.
    numbers = itertools.count(1000)
    stolen: list[str] = []

    class CutInto:
        def __iter__(self) -> CutInto:
            return self

        def __next__(self) -> int:
            number = next(numbers)
            if number == 1001 and not stolen:
                stolen.append(_envelope.new_id())  # takes 1002, from inside the batch's take
            return number

    monkeypatch.setattr(_envelope, "_time_ns", lambda: 1_700_000_000_000_000_000)
    monkeypatch.setattr(_envelope, "_sequence", CutInto())
    batch = [
        envelope.id
        for envelope in _envelope.make_envelopes(
            "t", range(4), _envelope.EMPTY_HEADERS, 1.0, None, (), None, None
        )
    ]
    assert len(stolen) == 1
    assert stolen[0] not in batch
    assert batch == sorted(batch) and len(set(batch)) == 4
    assert sorted([*batch, *stolen]) == [batch[0], batch[1], stolen[0], *batch[2:]]


def test_the_failure_logs_rate_limiter_counts_every_record_from_16_threads(
    scale: int, caplog: pytest.LogCaptureFixture
) -> None:
    per_thread = 2_000 * scale
    log = FailureLog(interval=3600.0, clock=lambda: 5.0)  # the window never closes
    entry = DeadLetter(
        Envelope(topic="orders", payload=None),
        DeadLetterReason.HANDLER_FAILED,
        "ValueError: boom",
        "orders@g",
        1,
        0.0,
    )

    def fail(_: int) -> None:
        for _ in range(per_thread):
            log.dead_lettered(entry, None)

    caplog.set_level(logging.WARNING, logger="asyncbus")
    in_threads(THREADS, fail)
    log.flush()
    records = [record for record in caplog.records if record.name == "asyncbus.dead_letters"]
    assert len(records) == 2  # the first, then what the window held back
    assert records[1].asyncbus_suppressed == THREADS * per_thread - 1


def test_switch_interval_holds_from_16_threads_at_once_all_come_undone(scale: int) -> None:
    before = sys.getswitchinterval()

    def hold_and_release(_: int) -> None:
        for _ in range(500 * scale):
            _offload.hold_switch_interval(0.0005)
            _offload.release_switch_interval()

    in_threads(THREADS, hold_and_release)
    assert (sys.getswitchinterval(), _offload._switch_holders) == (before, 0)


async def test_subscriptions_made_from_16_threads_while_the_bus_runs_all_start(
    assert_settled: Callable[[Bus], None],
) -> None:
    bus = Bus()
    handled: list[tuple[int, int]] = []

    def subscribe(thread: int) -> str:
        # A lambda gets a group of its own: the counter behind it is shared by threads.
        subscription = bus.subscribe(f"late.{thread}", lambda n: handled.append((thread, n)))
        return subscription.group

    with anyio.fail_after(30):
        async with bus:
            groups = await anyio.to_thread.run_sync(in_threads, THREADS, subscribe)
            for thread in range(THREADS):
                await bus.publish(f"late.{thread}", thread)
            await bus.drain()

    assert len(set(groups)) == THREADS
    assert sorted(handled) == [(thread, thread) for thread in range(THREADS)]
    assert_settled(bus)


_LAZY_IMPORTS_SCRIPT = """
import sys, threading
import asyncbus

names = ("RedisTransport", "NatsTransport", "RabbitTransport")
barrier = threading.Barrier(16)
found = [None] * 16

def look_up(index):
    barrier.wait(timeout=30)
    found[index] = tuple(getattr(asyncbus, name) for name in names)

threads = [threading.Thread(target=look_up, args=(index,)) for index in range(16)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=60)
assert all(classes == found[0] for classes in found), found
assert [cls.__name__ for cls in found[0]] == list(names)
gil = getattr(sys, "_is_gil_enabled", lambda: True)()
print("ok", asyncbus.FREE_THREADED, gil)
"""


def test_lazy_imports_raced_by_16_threads_in_a_fresh_interpreter_give_one_class_each() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _LAZY_IMPORTS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    ok, free_threaded, gil = done.stdout.split()
    assert ok == "ok"
    # The transports import no client library: importing them keeps the GIL off.
    assert free_threaded == str(asyncbus.FREE_THREADED)
    if asyncbus.FREE_THREADED:
        assert gil == "False"


@pytest.mark.parametrize("free_threaded", [True, False], ids=["free-threaded", "gil"])
async def test_the_bus_says_at_start_which_pool_runs_sync_handlers_and_why(
    free_threaded: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_runtime, "FREE_THREADED", free_threaded)
    caplog.set_level(logging.INFO, logger="asyncbus.bus")
    bus = Bus(workers=3, name="pool")

    @bus.subscribe("first", group="a")
    def first(n: int) -> int:
        return n

    @bus.subscribe("second", group="b", offload="thread")
    def second(n: int) -> int:
        return n

    @bus.subscribe("async", group="c")
    async def on_loop(n: int) -> int:
        return n

    with anyio.fail_after(10):
        async with bus:
            pass
        async with bus:  # told again on each start
            pass

    told = [
        record.getMessage()
        for record in caplog.records
        if record.name == "asyncbus.bus" and "worker thread pool" in record.getMessage()
    ]
    assert len(told) == 2 and told[0] == told[1]
    assert told[0].startswith(
        "bus 'pool': sync handlers (stage 'first@a' first) run on the worker thread pool, "
        "3 at a time (workers=3): "
    )
    if free_threaded:
        assert told[0].endswith("free-threaded build with the GIL off, so they run in parallel")
    else:
        assert "take turns" in told[0] and "offload='process' runs them in parallel" in told[0]


def test_statistics_read_from_a_thread_of_a_stopped_bus_need_no_loop() -> None:
    bus = Bus()
    bus.subscribe("jobs", lambda n: n, group="g")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        snapshots = list(pool.map(lambda _: bus.statistics(), range(8)))
    assert all(snapshot == snapshots[0] for snapshot in snapshots)
    assert snapshots[0].stage("jobs@g").published == 0


@pytest.fixture(params=SCALES)
def scale(request: pytest.FixtureRequest) -> int:
    """How many times the quick run's work a test does (the soak run: many times)."""
    value: int = request.param
    return value
