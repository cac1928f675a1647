"""Batch consume: ``subscribe(..., batch=Batch(...))`` calls the handler once per list."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncbus import (
    Adaptive,
    Admission,
    Batch,
    BatchError,
    Bus,
    ConfigurationError,
    Envelope,
    HandlerError,
    Reject,
    Retry,
    Skip,
    StageStatistics,
    middleware,
)
from asyncbus._instrument import Consumer, Instrumentation, Result
from asyncbus._observe import attach
from asyncbus.middleware import deduplicate
from asyncbus.middleware import timeout as timeout_middleware

pytestmark = pytest.mark.anyio


def stats(bus: Bus, topic: str = "t") -> StageStatistics:
    """The statistics of the one stage on ``topic``."""
    (stage,) = [stage for stage in bus.statistics().stages if stage.topic == topic]
    return stage


def ledger(stage: StageStatistics) -> tuple[int, int, int, int, int, int]:
    """``(published, acked, dead_lettered, abandoned, depth, in_flight)``."""
    return (
        stage.published,
        stage.acked,
        stage.dead_lettered,
        stage.abandoned,
        stage.depth,
        stage.in_flight,
    )


def balanced(stage: StageStatistics) -> bool:
    """The ledger's equation."""
    return stage.published == (
        stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
    )


def reasons(bus: Bus) -> list[tuple[Any, str, int]]:
    """``(payload, reason, attempts)`` of every dead letter, by payload."""
    return sorted(
        (entry.envelope.payload, entry.reason.value, entry.attempts)
        for entry in bus.dead_letters.list()
    )


# -- configuration ---------------------------------------------------------------


def test_batch_is_a_frozen_slotted_dataclass_with_defaults() -> None:
    batch = Batch()
    assert (batch.max_size, batch.max_wait) == (100, 0.05)
    assert Batch(3, 0) == Batch(max_size=3, max_wait=0.0)
    assert dataclasses.is_dataclass(Batch) and not hasattr(batch, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.max_size = 5  # type: ignore[misc]
    assert Batch.__doc__


@pytest.mark.parametrize(
    ("max_size", "max_wait"),
    [
        (0, 0.1),
        (-1, 0.1),
        (True, 0.1),
        (1.5, 0.1),
        ("3", 0.1),
        (3, -0.1),
        (3, float("nan")),
        (3, float("inf")),
        (3, True),
        (3, "0.1"),
    ],
)
def test_batch_refuses_what_cannot_work(max_size: Any, max_wait: Any) -> None:
    with pytest.raises(ConfigurationError, match="Batch: max_"):
        Batch(max_size=max_size, max_wait=max_wait)


def test_batch_error_keeps_its_failures_and_summarises_them() -> None:
    error = BatchError({2: ValueError("x"), 0: Reject("bad")})
    assert error.failures == {2: error.failures[2], 0: error.failures[0]}
    assert str(error) == "2 envelope(s) of the batch failed (0: Reject, 2: ValueError)"
    from asyncbus import AsyncbusError

    assert isinstance(error, AsyncbusError)


async def _payloads(items: list[Any]) -> None:
    return None


def test_subscribe_refuses_a_batch_larger_than_the_capacity() -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match="could never fill"):
        bus.subscribe("t", _payloads, batch=Batch(max_size=11), capacity=10)
    with pytest.raises(ConfigurationError, match="could never fill"):
        bus.subscribe("t", batch=Batch(max_size=11), capacity=10)  # the decorator form
    bus.subscribe("t", _payloads, batch=Batch(max_size=10), capacity=10)


def test_subscribe_refuses_what_is_not_a_batch() -> None:
    with pytest.raises(ConfigurationError, match="batch must be a Batch"):
        Bus().subscribe("t", _payloads, batch=10)  # type: ignore[arg-type]


def test_subscribe_refuses_a_batch_handler_annotated_with_one_envelope() -> None:
    async def one(envelope: Envelope) -> None:
        return None

    async def mapping(items: dict[str, Any]) -> None:
        return None

    bus = Bus()
    for handler in (one, mapping):
        with pytest.raises(ConfigurationError, match="a batch handler takes a list"):
            bus.subscribe("t", handler, batch=Batch())
    decorator = bus.subscribe("t", batch=Batch())
    with pytest.raises(ConfigurationError, match="a batch handler takes a list"):
        decorator(one)


def test_subscribe_refuses_a_generator_batch_handler() -> None:
    def generator(items: list[Any]) -> Any:
        yield from items

    with pytest.raises(ConfigurationError, match="generator function"):
        Bus().subscribe("t", generator, batch=Batch())


def test_subscribe_refuses_a_batch_with_adaptive_concurrency_or_admission() -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match="Adaptive concurrency"):
        bus.subscribe("t", _payloads, batch=Batch(), concurrency=Adaptive())
    with pytest.raises(ConfigurationError, match="admission="):
        bus.subscribe("t", _payloads, batch=Batch(), admission=Admission())


# -- forming batches ---------------------------------------------------------------


async def test_a_consumer_takes_what_is_queued_up_to_max_size_in_queue_order() -> None:
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> None:
        batches.append(list(items))

    with anyio.fail_after(5):
        async with bus:
            for n in range(25):
                bus.publish_nowait("t", n)
            await bus.drain()
            assert batches == [list(range(10)), list(range(10, 20)), list(range(20, 25))]
            assert ledger(stats(bus)) == (25, 25, 0, 0, 0, 0)


async def test_one_envelope_queued_is_a_batch_of_one_after_max_wait() -> None:
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0.01))
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
    assert batches == [[1]]


async def test_each_of_several_consumers_forms_its_own_batches() -> None:
    release = anyio.Event()
    holding: list[list[int]] = []
    both = anyio.Event()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=2, max_wait=0), concurrency=2)
    async def handle(items: list[int]) -> None:
        holding.append(items)
        if len(holding) == 2:
            both.set()
        await release.wait()

    with anyio.fail_after(5):
        async with bus:
            for n in range(5):
                bus.publish_nowait("t", n)
            await both.wait()
            assert sorted(holding) == [[0, 1], [2, 3]]
            assert ledger(stats(bus)) == (5, 0, 0, 0, 1, 4)
            release.set()
            await bus.drain()
    assert sorted(holding) == [[0, 1], [2, 3], [4]]
    assert ledger(stats(bus)) == (5, 5, 0, 0, 0, 0)


async def test_the_ledger_balances_while_a_batch_is_handled() -> None:
    seen: list[tuple[int, ...]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=4, max_wait=0), capacity=4)
    async def handle(items: list[int]) -> None:
        stage = stats(bus)
        assert balanced(stage)
        seen.append((stage.depth, stage.in_flight))

    async def publish_all() -> None:
        for n in range(10):
            await bus.publish("t", n)
            assert balanced(stats(bus))

    with anyio.fail_after(5):
        async with bus:
            await publish_all()
            await bus.drain()
            assert ledger(stats(bus)) == (10, 10, 0, 0, 0, 0)
    assert sum(in_flight for _, in_flight in seen) == 10


async def test_saturation_counts_a_batch_consumer_once_however_many_it_holds() -> None:
    inside = anyio.Event()
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=50, max_wait=0), capacity=100, concurrency=2)
    async def handle(items: list[int]) -> None:
        inside.set()
        await release.wait()

    with anyio.fail_after(5):
        async with bus:
            await bus.publish_many("t", range(50))
            await inside.wait()
            stage = stats(bus)
            # One of the two consumers holds a batch of fifty: half the consumers are busy.
            assert (stage.in_flight, stage.limit, stage.saturation) == (50, 2, 0.5)
            await bus.publish_many("t", range(50, 100))
            await anyio.wait_all_tasks_blocked()
            stage = stats(bus)
            assert (stage.in_flight, stage.saturation) == (100, 1.0)
            release.set()
            await bus.drain()
            assert stats(bus).saturation == 0.0
    assert ledger(stats(bus)) == (100, 100, 0, 0, 0, 0)


async def test_a_blocked_publish_enters_as_a_batch_frees_room() -> None:
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), capacity=3)
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            async with anyio.create_task_group() as group:
                for n in range(9):
                    group.start_soon(bus.publish, "t", n)
            await bus.drain()
    assert sorted(n for batch in batches for n in batch) == list(range(9))
    assert all(1 <= len(batch) <= 3 for batch in batches)
    assert ledger(stats(bus)) == (9, 9, 0, 0, 0, 0)


# -- what the handler gets ---------------------------------------------------------


async def test_a_list_of_envelopes_annotation_gets_the_envelopes() -> None:
    got: list[Any] = []
    bus = Bus()

    @bus.subscribe("a", batch=Batch(max_size=5, max_wait=0))
    async def envelopes(items: list[Envelope]) -> None:
        got.append([(type(item).__name__, item.payload) for item in items])

    @bus.subscribe("b", batch=Batch(max_size=5, max_wait=0))
    async def sequence(items: Sequence[Envelope]) -> None:
        got.append([item.topic for item in items])

    with anyio.fail_after(5):
        async with bus:
            bus.publish_nowait("a", 1)
            bus.publish_nowait("a", 2)
            bus.publish_nowait("b", 3)
            await bus.drain()
    assert sorted(got, key=str) == sorted([[("Envelope", 1), ("Envelope", 2)], ["b"]], key=str)


@dataclasses.dataclass
class Point:
    x: int
    y: int


async def test_a_list_of_models_gets_them_decoded_and_an_undecodable_one_is_rejected() -> None:
    got: list[list[Point]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=5, max_wait=0), retry=Retry(max_attempts=3))
    async def handle(points: list[Point]) -> None:
        got.append(points)

    with anyio.fail_after(5):
        async with bus:
            bus.publish_nowait("t", {"x": 1, "y": 2})
            bus.publish_nowait("t", {"x": "nope"})
            bus.publish_nowait("t", Point(3, 4))
            await bus.drain()
    assert got == [[Point(1, 2), Point(3, 4)]]
    assert reasons(bus) == [({"x": "nope"}, "rejected", 1)]
    (entry,) = bus.dead_letters.list()
    assert entry.error is not None and entry.error.startswith("DecodeError: ")
    assert ledger(stats(bus)) == (3, 2, 1, 0, 0, 0)


async def test_a_sync_batch_handler_runs_once_per_batch_on_a_worker_thread() -> None:
    threads: list[int] = []
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=4, max_wait=0))
    def handle(items: list[int]) -> None:
        threads.append(threading.get_ident())
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            for n in range(6):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[0, 1, 2, 3], [4, 5]]
    assert threading.get_ident() not in threads
    assert ledger(stats(bus)) == (6, 6, 0, 0, 0, 0)


async def test_an_inline_sync_batch_handler_runs_on_the_loop() -> None:
    threads: list[int] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=4, max_wait=0), offload="inline")
    def handle(items: list[int]) -> None:
        threads.append(threading.get_ident())

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert threads == [threading.get_ident()]


# -- outcomes ----------------------------------------------------------------------


async def test_returned_results_go_along_each_envelopes_slip_and_to_its_requester() -> None:
    forwarded: list[int] = []
    bus = Bus()

    @bus.subscribe("double", batch=Batch(max_size=10, max_wait=0))
    async def double(items: list[int]) -> list[int]:
        return [item * 2 for item in items]

    @bus.subscribe("after")
    async def after(value: int) -> None:
        forwarded.append(value)

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("double", n, slip=["after"])
            assert await bus.request("double", 21) == 42
            await bus.drain()
    assert sorted(forwarded) == [0, 2, 4]
    assert ledger(stats(bus, "double")) == (4, 4, 0, 0, 0, 0)


async def test_a_wrong_return_value_dead_letters_every_envelope() -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0), retry=Retry(max_attempts=3))
    async def handle(items: list[int]) -> list[int]:
        return items[:1]

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert reasons(bus) == [
        (0, "handler_failed", 1),
        (1, "handler_failed", 1),
        (2, "handler_failed", 1),
    ]
    error = bus.dead_letters.list()[0].error
    assert error == (
        "TypeError: the batch handler returned a list of 1 item(s); it must return None or "
        "a list with one result per item (3)"
    )
    assert ledger(stats(bus)) == (3, 0, 3, 0, 0, 0)


async def test_an_exception_fails_every_envelope_each_retried_then_dead_lettered() -> None:
    batches: list[list[tuple[int, int]]] = []
    bus = Bus()

    @bus.subscribe(
        "t", batch=Batch(max_size=10, max_wait=0), retry=Retry(max_attempts=3, backoff=0)
    )
    async def handle(items: list[Envelope]) -> None:
        batches.append([(item.payload, item.attempt) for item in items])
        raise RuntimeError("down")

    with anyio.fail_after(5):
        async with bus:
            for n in range(4):
                bus.publish_nowait("t", n)
            await bus.drain()
    handled = sorted(pair for batch in batches for pair in batch)
    assert handled == [(n, attempt) for n in range(4) for attempt in (1, 2, 3)]
    assert batches[0] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert reasons(bus) == [(n, "handler_failed", 3) for n in range(4)]
    stage = stats(bus)
    assert ledger(stage) == (4, 0, 4, 0, 0, 0)
    assert (stage.failed, stage.retried) == (12, 8)


async def test_reject_dead_letters_every_envelope_of_the_batch_at_once() -> None:
    calls: list[int] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0), retry=Retry(max_attempts=5))
    async def handle(items: list[int]) -> None:
        calls.append(len(items))
        raise Reject("poison")

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert calls == [3]
    assert reasons(bus) == [(0, "rejected", 1), (1, "rejected", 1), (2, "rejected", 1)]
    assert {entry.error for entry in bus.dead_letters.list()} == {"Reject: poison"}


async def test_batch_error_fails_only_its_positions_and_acks_the_rest() -> None:
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe(
        "t", batch=Batch(max_size=10, max_wait=0), retry=Retry(max_attempts=2, backoff=0)
    )
    async def handle(items: list[int]) -> None:
        batches.append(items)
        failures: dict[int, BaseException] = {}
        for position, item in enumerate(items):
            if item == 1:
                failures[position] = ValueError(f"bad {item}")
            elif item == 3:
                failures[position] = Reject("never")
        if failures:
            raise BatchError(failures)

    with anyio.fail_after(5):
        async with bus:
            for n in range(5):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[0, 1, 2, 3, 4], [1]]
    assert reasons(bus) == [(1, "handler_failed", 2), (3, "rejected", 1)]
    errors = sorted(entry.error or "" for entry in bus.dead_letters.list())
    assert errors == ["Reject: never", "ValueError: bad 1"]
    stage = stats(bus)
    assert ledger(stage) == (5, 3, 2, 0, 0, 0)
    assert (stage.failed, stage.retried) == (3, 1)


async def test_batch_error_naming_a_position_out_of_range_fails_the_whole_batch() -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> None:
        raise BatchError({len(items): ValueError("where?")})

    with anyio.fail_after(5):
        async with bus:
            for n in range(2):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert reasons(bus) == [(0, "handler_failed", 1), (1, "handler_failed", 1)]
    assert {entry.error for entry in bus.dead_letters.list()} == {
        "ValueError: BatchError names position(s) 2, but the batch handler was given 2 "
        "item(s) (positions 0 to 1)"
    }


@pytest.mark.parametrize("with_middleware", [False, True], ids=["fast", "per_envelope"])
async def test_batch_error_gives_no_result_so_an_unnamed_hop_or_request_fails_loudly(
    with_middleware: bool,
) -> None:
    forwarded: list[Any] = []

    @middleware
    async def passing(envelope: Envelope, call_next: Any) -> Any:
        return await call_next(envelope)

    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=10, max_wait=0.05),
        middleware=[passing] if with_middleware else [],
    )
    async def handle(items: list[int]) -> None:
        raise BatchError({p: ValueError("bad") for p, item in enumerate(items) if item == 0})

    @bus.subscribe("next", group="next")
    async def next_hop(payload: Any) -> None:
        forwarded.append(payload)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 0)  # named: it failed
            await bus.publish("t", 1, slip=["next"])  # not named, and a hop follows
            await bus.publish("t", 2)  # not named, nothing follows: acked
            with pytest.raises(HandlerError) as raised:
                await bus.request("t", 3)  # not named, and a requester waits
            await bus.drain()
    # Nothing is sent on as if the handler had returned None for 1 and 3.
    assert forwarded == []
    assert isinstance(raised.value.__cause__, TypeError)
    assert reasons(bus) == [
        (0, "handler_failed", 1),
        (1, "handler_failed", 1),
        (3, "handler_failed", 1),
    ]
    loud = {entry.envelope.payload: entry.error for entry in bus.dead_letters.list()}
    assert loud[1] is not None and loud[1].startswith("TypeError: BatchError named no failure")
    assert "return a list with one result per item" in loud[1]
    assert loud[3] == loud[1]
    stage = stats(bus)
    assert (stage.published, stage.acked, stage.dead_lettered) == (4, 1, 3)


async def test_a_failed_request_in_a_batch_fails_its_requester() -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> list[int]:
        raise BatchError({0: ValueError("no")})

    with anyio.fail_after(5):
        async with bus:
            with pytest.raises(HandlerError) as raised:
                await bus.request("t", 1)
    assert isinstance(raised.value.__cause__, ValueError)


async def test_the_timeout_bounds_the_batch_call_and_each_envelope_times_out() -> None:
    calls: list[int] = []
    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=10, max_wait=0),
        timeout=0.05,
        retry=Retry(max_attempts=2, backoff=0),
    )
    async def handle(items: list[int]) -> None:
        calls.append(len(items))
        await anyio.sleep_forever()

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert calls == [3, 3]
    assert reasons(bus) == [(0, "timeout", 2), (1, "timeout", 2), (2, "timeout", 2)]


async def test_failures_are_logged_per_envelope(caplog: pytest.LogCaptureFixture) -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> None:
        raise RuntimeError("down")

    with caplog.at_level(logging.WARNING, logger="asyncbus"), anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    # As for per-message handlers: one record per envelope, rate-limited per stage
    # (the first is written, the others are counted in one summary).
    messages = [record.getMessage() for record in caplog.records]
    (first,) = [message for message in messages if message.startswith("dead-lettered")]
    assert bus.dead_letters.list()[0].envelope.id in first
    assert [m for m in messages if "suppressed" in m] == [
        f"2 more handler_failed record(s) for stage {stats(bus).name!r} were suppressed"
    ]


# -- middleware ----------------------------------------------------------------------


async def test_middleware_sees_each_envelope_and_the_handler_one_batch() -> None:
    seen: list[Any] = []
    batches: list[list[int]] = []

    @middleware
    async def record(envelope: Envelope, call_next: Any) -> Any:
        seen.append(("before", envelope.payload))
        result = await call_next(envelope)
        seen.append(("after", envelope.payload, result))
        return result

    @middleware
    async def skip_two(envelope: Envelope, call_next: Any) -> Any:
        if envelope.payload == 2:
            return Skip()
        return await call_next(envelope)

    bus = Bus(middleware=[record])

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0), middleware=[skip_two])
    async def handle(items: list[int]) -> list[str]:
        batches.append(items)
        return [f"r{item}" for item in items]

    with anyio.fail_after(5):
        async with bus:
            for n in range(4):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[0, 1, 3]]
    assert sorted(entry for entry in seen if entry[0] == "before") == [
        ("before", n) for n in range(4)
    ]
    after = sorted((entry[1], repr(entry[2])) for entry in seen if entry[0] == "after")
    assert after == [(0, "'r0'"), (1, "'r1'"), (2, "Skip()"), (3, "'r3'")]
    assert ledger(stats(bus)) == (4, 4, 0, 0, 0, 0)


async def test_a_middleware_failure_fails_only_its_envelope() -> None:
    batches: list[list[int]] = []

    @middleware
    async def refuse_one(envelope: Envelope, call_next: Any) -> Any:
        if envelope.payload == 1:
            raise RuntimeError("middleware says no")
        return await call_next(envelope)

    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0), middleware=[refuse_one])
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[0, 2]]
    assert reasons(bus) == [(1, "handler_failed", 1)]


@pytest.mark.parametrize(
    "retry", [None, Retry(max_attempts=2, backoff=0)], ids=["one attempt", "retried"]
)
async def test_envelopes_whose_wait_timed_out_are_never_handed_to_the_handler(
    retry: Retry | None,
) -> None:
    batches: list[list[int]] = []

    @middleware
    async def hang_on_three(envelope: Envelope, call_next: Any) -> Any:
        if envelope.payload == 3:
            await anyio.sleep_forever()
        return await call_next(envelope)

    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=5, max_wait=0.05),
        middleware=[timeout_middleware(0.2), hang_on_three],
        retry=retry,
    )
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(10):
        async with bus:
            # 3 last: its chain starts (and its timeout with it) after every other
            # envelope's, however the machine schedules them.
            for n in (0, 1, 2, 4, 3):
                bus.publish_nowait("t", n)
            await bus.drain()
    # The batch waited for 3 until every envelope's timeout ended its wait: each one
    # timed out, so none of them may reach the handler.
    attempts = 1 if retry is None else 2
    assert batches == []
    assert reasons(bus) == [(n, "timeout", attempts) for n in range(5)]
    assert ledger(stats(bus)) == (5, 0, 5, 0, 0, 0)


async def test_an_envelope_whose_chain_gave_up_before_the_call_is_left_out_of_it() -> None:
    batches: list[list[int]] = []

    @middleware
    async def impatient(envelope: Envelope, call_next: Any) -> Any:
        if envelope.payload == 0:
            with anyio.move_on_after(0.05):
                return await call_next(envelope)
            raise RuntimeError("gave up waiting for the batch")
        if envelope.payload == 3:
            await anyio.sleep(0.3)
            raise RuntimeError("fails late")
        return await call_next(envelope)

    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=5, max_wait=0.05), middleware=[impatient])
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(10):
        async with bus:
            for n in range(5):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[1, 2, 4]]  # 0's chain had ended: it is dead-lettered, not handled
    assert reasons(bus) == [(0, "handler_failed", 1), (3, "handler_failed", 1)]
    assert ledger(stats(bus)) == (5, 3, 2, 0, 0, 0)


async def test_a_batch_call_still_running_at_its_envelopes_timeout_is_cancelled() -> None:
    ended: list[bool] = []
    done = anyio.Event()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), middleware=[timeout_middleware(0.2)])
    async def handle(items: list[int]) -> None:
        completed = False
        try:
            await anyio.sleep(0.6)
            completed = True
        finally:
            ended.append(completed)
            done.set()

    with anyio.fail_after(10):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await done.wait()
            await bus.drain()
    # Every envelope timed out, as a per-message handler is cancelled at its timeout:
    # the call must not go on to do their work.
    assert ended == [False]
    assert reasons(bus) == [(n, "timeout", 1) for n in range(3)]
    assert ledger(stats(bus)) == (3, 0, 3, 0, 0, 0)


@pytest.mark.parametrize("with_middleware", [False, True], ids=["fast", "per_envelope"])
async def test_expired_envelopes_are_dead_lettered_never_handled(with_middleware: bool) -> None:
    batches: list[list[int]] = []

    @middleware
    async def passing(envelope: Envelope, call_next: Any) -> Any:
        return await call_next(envelope)

    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=10, max_wait=0),
        middleware=[passing] if with_middleware else [],
    )
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            bus.publish_nowait("t", 0)
            bus.publish_nowait("t", 1, ttl=1e-9)
            bus.publish_nowait("t", 2, ttl=60)
            await bus.drain()
    assert batches == [[0, 2]]
    assert reasons(bus) == [(1, "expired", 1)]
    stage = stats(bus)
    assert ledger(stage) == (3, 2, 1, 0, 0, 0)
    assert stage.expired == 1


async def test_deduplicate_skips_a_duplicate_in_a_batch() -> None:
    batches: list[list[int]] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0), middleware=[deduplicate()])
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="same")
            await bus.drain()
            await bus.publish("t", 2, id="same")
            await bus.publish("t", 3)
            await bus.drain()
    assert [sorted(batch) for batch in batches] == [[1], [3]]
    assert ledger(stats(bus)) == (3, 3, 0, 0, 0, 0)


class _Recording(Instrumentation):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any, str]] = []

    def enter(self, consumer: Consumer, envelope: Envelope) -> object:
        self.events.append(("enter", envelope.payload, consumer.stage))
        return envelope.payload

    def exit(self, token: object, result: Result) -> None:
        self.events.append(("exit", token, result.outcome))


async def test_an_instrumentation_sees_each_envelope_of_a_batch() -> None:
    batches: list[list[int]] = []
    recording = _Recording()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> None:
        batches.append(items)
        if 1 in items:
            raise BatchError({items.index(1): Reject("one")})

    with anyio.fail_after(5):
        async with bus:
            attach(bus, recording)
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert batches == [[0, 1, 2]]
    stage = stats(bus).name
    assert sorted(e for e in recording.events if e[0] == "enter") == [
        ("enter", n, stage) for n in range(3)
    ]
    assert sorted(e for e in recording.events if e[0] == "exit") == [
        ("exit", 0, "acked"),
        ("exit", 1, "dead_lettered"),
        ("exit", 2, "acked"),
    ]


async def test_the_pass_through_chain_runs_batches_without_a_task_per_envelope(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncbus._batching as batching

    async def no_tasks(*args: Any) -> None:
        raise AssertionError("a task per envelope on the pass-through path")

    monkeypatch.setattr(batching, "_run_each", no_tasks)
    tasks: set[Any] = set()
    bus = Bus()

    @bus.subscribe(
        "t", batch=Batch(max_size=10, max_wait=0), retry=Retry(max_attempts=2, backoff=0)
    )
    async def handle(items: list[int]) -> None:
        tasks.add(anyio.get_current_task().id)
        if items[0] == 0:
            raise BatchError({0: ValueError("again")})

    with anyio.fail_after(5):
        async with bus:
            for n in range(20):
                bus.publish_nowait("t", n)
            await bus.drain()
    assert len(tasks) == 1  # the consumer's own task, for every batch
    assert ledger(stats(bus)) == (20, 19, 1, 0, 0, 0)


# -- shutdown ----------------------------------------------------------------------


async def test_a_batch_in_flight_at_the_deadline_is_abandoned_envelope_by_envelope() -> None:
    started = anyio.Event()
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0))
    async def handle(items: list[int]) -> None:
        started.set()
        await anyio.sleep_forever()

    with anyio.fail_after(5):
        async with bus:
            receipts = [bus.publish_nowait("t", n) for n in range(4)]
            await started.wait()
            report = await bus.aclose(timeout=0.05)
    assert not report.drained
    assert sorted(report.abandoned) == sorted(receipt.id for receipt in receipts)
    assert ledger(stats(bus)) == (4, 0, 0, 4, 0, 0)


async def test_a_batch_waiting_to_fill_at_the_deadline_is_abandoned() -> None:
    bus = Bus()
    handled: list[list[int]] = []

    @bus.subscribe("t", batch=Batch(max_size=5, max_wait=60))
    async def handle(items: list[int]) -> None:
        handled.append(items)

    with anyio.fail_after(5):
        async with bus:
            receipts = [bus.publish_nowait("t", n) for n in range(2)]
            await anyio.wait_all_tasks_blocked()
            assert ledger(stats(bus)) == (2, 0, 0, 0, 0, 2)  # held, waiting for more
            report = await bus.aclose(timeout=0.05)
    assert handled == []
    assert sorted(report.abandoned) == sorted(receipt.id for receipt in receipts)
    assert ledger(stats(bus)) == (2, 0, 0, 2, 0, 0)


async def test_drain_waits_for_a_batch_in_flight() -> None:
    release = anyio.Event()
    done: list[int] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0))
    async def handle(items: list[int]) -> None:
        await release.wait()
        done.extend(items)

    async def later() -> None:
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert done == []
        release.set()

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            async with anyio.create_task_group() as group:
                group.start_soon(later)
                await bus.drain()
            assert done == [0, 1, 2]


async def test_a_publish_inside_a_batch_handler_starts_its_own_conversation() -> None:
    out: list[Envelope] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> None:
        await bus.publish("out", sum(items))

    @bus.subscribe("out")
    async def collect(envelope: Envelope) -> None:
        out.append(envelope)

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n)
            await bus.drain()
    [envelope] = out
    assert (envelope.payload, envelope.causation_id) == (3, None)


async def test_an_item_of_the_returned_list_may_be_a_verdict() -> None:
    forwarded: list[int] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=10, max_wait=0))
    async def handle(items: list[int]) -> list[Any]:
        return [Skip() if item == 1 else item for item in items]

    @bus.subscribe("next")
    async def after(value: int) -> None:
        forwarded.append(value)

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n, slip=["next"])
            await bus.drain()
    assert sorted(forwarded) == [0, 2]  # a skipped envelope is acked, not forwarded
    assert ledger(stats(bus)) == (3, 3, 0, 0, 0, 0)


async def test_two_copies_of_one_envelope_in_a_batch_do_not_wait_for_each_other() -> None:
    from asyncbus._dedup import MemoryDedupStore

    batches: list[list[int]] = []
    bus = Bus()

    # A claiming store (as a broker's): a copy waits while the other holds the claim.
    @bus.subscribe(
        "t",
        batch=Batch(max_size=10, max_wait=0),
        middleware=[deduplicate(store=MemoryDedupStore())],
    )
    async def handle(items: list[int]) -> None:
        batches.append(items)

    with anyio.fail_after(5):
        async with bus:
            bus.publish_nowait("t", 1, id="same")
            bus.publish_nowait("t", 2, id="same")
            bus.publish_nowait("t", 3)
            await bus.drain()
    assert batches == [[1, 3]]  # the second copy found the first done: skipped
    assert ledger(stats(bus)) == (3, 3, 0, 0, 0, 0)


async def test_a_batch_handler_in_a_worker_process_gets_the_list_once() -> None:
    import importlib
    import os
    import sys
    from pathlib import Path

    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.append(tests_dir)  # the worker imports the handler by module name
    handlers = importlib.import_module("_process_handlers")
    results: list[tuple[int, int]] = []
    bus = Bus()
    bus.subscribe("t", handlers.squares, batch=Batch(max_size=10, max_wait=0), offload="process")

    @bus.subscribe("sink")
    async def sink(result: tuple[int, int]) -> None:
        results.append(tuple(result))  # type: ignore[arg-type]

    with anyio.fail_after(30):
        async with bus:
            for n in range(3):
                bus.publish_nowait("t", n, slip=["sink"])
            await bus.drain()
    assert sorted(square for square, _ in results) == [0, 1, 4]
    assert len({pid for _, pid in results}) == 1  # one call, in one worker process
    assert os.getpid() not in {pid for _, pid in results}
