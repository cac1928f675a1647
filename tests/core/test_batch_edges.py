"""Batch consume and ``publish_many`` at their edges: drain and publishes from a batch
handler, malformed ``BatchError``s, odd input, cancellation and the ledger after each."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncbus import (
    HEADER_REPLAYED,
    Batch,
    BatchError,
    Bus,
    Envelope,
    Retry,
    StageStatistics,
    middleware,
)
from asyncbus._batch import Failed, outcomes
from asyncbus._types import Handler

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


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


@middleware
async def passing(envelope: Envelope, call_next: Handler) -> Any:
    """A user middleware: makes a batch stage run each envelope's chain in a task."""
    return await call_next(envelope)


async def a_cancellation() -> BaseException:
    """An instance of the backend's cancellation exception (trio's has no constructor)."""
    caught: list[BaseException] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.lowlevel.checkpoint()
        except anyio.get_cancelled_exc_class() as error:
            caught.append(error)
            raise
    return caught[0]


#: The two ways a batch runs: the consumer's own fast path, and a chain per envelope.
PATHS = [pytest.param((), id="fast"), pytest.param((passing,), id="per-envelope")]


# -- drain() inside a batch handler --------------------------------------------------


@pytest.mark.parametrize("layers", PATHS)
async def test_drain_inside_a_batch_handler_waits_for_the_rest_not_its_own_batch(
    layers: tuple[Any, ...],
) -> None:
    order: list[str] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), middleware=layers)
    async def handle(items: list[int]) -> None:
        order.append(f"batch {items}")
        await bus.publish_many("side", items)
        with anyio.fail_after(5):  # (before the fix: waited for its own batch)
            await bus.drain()
        order.append("drained")

    @bus.subscribe("side")
    async def side(item: int) -> None:
        order.append(f"side {item}")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
    assert order == ["batch [0, 1, 2]", "side 0", "side 1", "side 2", "drained"]
    assert ledger(stats(bus)) == (3, 3, 0, 0, 0, 0)
    assert ledger(stats(bus, "side")) == (3, 3, 0, 0, 0, 0)
    assert len(bus.dead_letters) == 0


async def test_drain_inside_a_batch_handler_still_waits_for_another_consumers_batch() -> None:
    release = anyio.Event()
    order: list[str] = []
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=2, max_wait=0), concurrency=2)
    async def handle(items: list[int]) -> None:
        if items == [0, 1]:
            order.append("first")
            await bus.drain()  # waits for the other consumer's batch
            order.append("first drained")
        else:
            order.append("second")
            await release.wait()
            order.append("second done")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(4))
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert order == ["first", "second"]
            release.set()
            await bus.drain()
    assert order == ["first", "second", "second done", "first drained"]
    assert ledger(stats(bus)) == (4, 4, 0, 0, 0, 0)


# -- a malformed BatchError -------------------------------------------------------------


@pytest.mark.parametrize("layers", PATHS)
@pytest.mark.parametrize(
    "failure",
    [
        pytest.param("not an exception", id="a-string"),
        pytest.param(KeyboardInterrupt(), id="KeyboardInterrupt"),
        pytest.param(SystemExit(3), id="SystemExit"),
        pytest.param(None, id="cancelled"),
    ],
)
async def test_a_batch_error_whose_failure_is_not_an_exception_fails_the_whole_batch(
    layers: tuple[Any, ...], failure: Any
) -> None:
    # (Before the fix: a string crashed the fast path's consumer and the bus; a
    # KeyboardInterrupt in it stopped the bus on the per-envelope path.)
    if failure is None:
        failure = await a_cancellation()
    calls: list[list[int]] = []
    bus = Bus()

    @bus.subscribe(
        "t",
        batch=Batch(max_size=3, max_wait=0),
        middleware=layers,
        retry=Retry(max_attempts=2, backoff=0),
    )
    async def handle(items: list[int]) -> None:
        calls.append(items)
        raise BatchError({0: failure})

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
            # The bus still runs.
            assert (await bus.publish("t", 9)).accepted
            await bus.drain()
    shown = repr(failure) if isinstance(failure, str) else f"a {type(failure).__name__}"
    assert calls[0] == [0, 1, 2]
    entries = bus.dead_letters.list()
    assert sorted(entry.envelope.payload for entry in entries) == [0, 1, 2, 9]
    assert {(entry.reason.value, entry.attempts) for entry in entries} == {("handler_failed", 2)}
    assert {entry.error for entry in entries} == {
        "TypeError: BatchError's failures must be exceptions (instances of Exception); "
        f"position 0 has {shown}"
    }
    stage = stats(bus)
    assert ledger(stage) == (4, 0, 4, 0, 0, 0)
    assert (stage.failed, stage.retried) == (8, 4)


def test_outcomes_refuse_a_failure_that_is_not_an_exception_naming_its_position() -> None:
    error = BatchError({1: "oops", 0: ValueError("fine")})  # type: ignore[dict-item]
    each = outcomes(2, None, error)
    assert [type(outcome) for outcome in each] == [Failed, Failed]
    failure = each[0].error
    assert isinstance(failure, TypeError) and failure.__cause__ is error
    assert str(failure) == (
        "BatchError's failures must be exceptions (instances of Exception); position 1 has 'oops'"
    )


def test_outcomes_name_wrong_positions_before_wrong_failures() -> None:
    error = BatchError({True: ValueError(), -1: "x", 0: ValueError()})  # type: ignore[dict-item]
    (failure, _) = [outcome.error for outcome in outcomes(2, None, error)]
    assert isinstance(failure, ValueError)
    assert str(failure).startswith("BatchError names position(s) True, -1, but")


# -- what held: pinned ----------------------------------------------------------------


async def test_a_publish_many_cancelled_while_blocked_keeps_what_it_admitted_and_no_more() -> None:
    release = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("t", capacity=4, batch=Batch(max_size=2, max_wait=0))
    async def handle(items: list[int]) -> None:
        await release.wait()
        handled.extend(items)

    with anyio.fail_after(10):
        async with bus:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(bus.publish_many, "t", range(20))
                    await anyio.wait_all_tasks_blocked()
                    scope.cancel()
            # 2 taken by the consumer, 4 queued; the publisher waited for room for the rest.
            assert ledger(stats(bus)) == (6, 0, 0, 0, 4, 2)
            release.set()
            await bus.drain()
    assert handled == [0, 1, 2, 3, 4, 5]
    assert ledger(stats(bus)) == (6, 6, 0, 0, 0, 0)


async def test_two_publish_many_into_one_full_block_stage_keep_each_order_and_the_ledger() -> None:
    handled: list[tuple[str, int]] = []
    bus = Bus()

    @bus.subscribe("t", capacity=4, batch=Batch(max_size=3, max_wait=0))
    async def handle(items: list[tuple[str, int]]) -> None:
        handled.extend(items)
        await anyio.lowlevel.checkpoint()

    with anyio.fail_after(10):
        async with bus:
            async with anyio.create_task_group() as group:
                for name in ("a", "b"):
                    group.start_soon(bus.publish_many, "t", [(name, n) for n in range(50)])
            await bus.drain()
    for name in ("a", "b"):
        assert [n for who, n in handled if who == name] == list(range(50))
    assert ledger(stats(bus)) == (100, 100, 0, 0, 0, 0)


async def test_a_generator_of_payloads_that_raises_publishes_nothing() -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0))
    async def handle(items: list[int]) -> None:
        pass

    def payloads() -> Any:
        yield 1
        yield 2
        raise LookupError("midway")

    with anyio.fail_after(10):
        async with bus:
            with pytest.raises(LookupError, match="midway"):
                await bus.publish_many("t", payloads())
            await bus.drain()
    assert ledger(stats(bus)) == (0, 0, 0, 0, 0, 0)


async def test_drain_in_a_middleware_of_a_batch_stage_leaves_out_the_whole_batch() -> None:
    order: list[str] = []
    bus = Bus()

    @middleware
    async def draining(envelope: Envelope, call_next: Handler) -> Any:
        if envelope.payload == 0:
            with anyio.fail_after(5):  # (before: the other members waited for this one)
                await bus.drain()
            order.append("drained")
        return await call_next(envelope)

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), middleware=[draining])
    async def handle(items: list[int]) -> None:
        order.append(f"batch {items}")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
    assert order == ["drained", "batch [0, 1, 2]"]
    assert ledger(stats(bus)) == (3, 3, 0, 0, 0, 0)
    assert len(bus.dead_letters) == 0


class Position:
    """An integer position that is not an ``int`` (as numpy's integers are not)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"Position({self.value})"


def test_outcomes_take_any_integer_as_a_position() -> None:
    failure = ValueError("bad")
    each = outcomes(3, None, BatchError({Position(1): failure}))  # type: ignore[dict-item]
    assert each[0] is None and each[2] is None
    assert isinstance(each[1], Failed) and each[1].error is failure


def test_outcomes_refuse_a_position_named_twice() -> None:
    error = BatchError({1: ValueError(), Position(1): ValueError()})  # type: ignore[dict-item]
    (failure, _, _) = [outcome.error for outcome in outcomes(3, None, error)]
    assert isinstance(failure, ValueError) and failure.__cause__ is error
    assert str(failure) == "BatchError names position(s) 1 more than once"


@pytest.mark.parametrize("layers", PATHS)
async def test_a_batch_error_with_integer_like_positions_fails_only_those(
    layers: tuple[Any, ...],
) -> None:
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0), middleware=layers)
    async def handle(items: list[int]) -> None:
        raise BatchError({Position(1): ValueError("one")})  # type: ignore[dict-item]

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
    [entry] = bus.dead_letters.list()
    assert (entry.envelope.payload, entry.reason.value, entry.error) == (
        1,
        "handler_failed",
        "ValueError: one",
    )
    assert ledger(stats(bus)) == (3, 2, 1, 0, 0, 0)


async def test_a_failed_batch_is_announced_per_envelope_and_replayed_as_a_batch() -> None:
    announced: list[Any] = []
    batches: list[list[tuple[int, int, bool]]] = []
    fail = True
    bus = Bus()

    @bus.subscribe("t", batch=Batch(max_size=3, max_wait=0))
    async def handle(items: list[Envelope]) -> None:
        batches.append([(e.payload, e.attempt, HEADER_REPLAYED in e.headers) for e in items])
        if fail:
            raise ValueError("down")

    @bus.subscribe("$deadletter")
    async def announce(entry: Any) -> None:
        announced.append((entry.envelope.payload, entry.reason.value))

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", range(3))
            await bus.drain()
            assert sorted(announced) == [
                (0, "handler_failed"),
                (1, "handler_failed"),
                (2, "handler_failed"),
            ]
            fail = False
            await bus.dead_letters.replay(*(e.envelope.id for e in bus.dead_letters.list()))
            await bus.drain()
    assert batches[0] == [(0, 1, False), (1, 1, False), (2, 1, False)]
    assert sorted(item for batch in batches[1:] for item in batch) == [
        (0, 1, True),
        (1, 1, True),
        (2, 1, True),
    ]
    assert len(announced) == 3 and len(bus.dead_letters) == 0
    stage = stats(bus)
    assert ledger(stage) == (6, 3, 3, 0, 0, 0)
