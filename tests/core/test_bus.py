"""The bus: subscribe, groups, patterns, handler forms, the ledger, and bad input."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from asyncbus import (
    Backpressure,
    Bus,
    BusClosedError,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    StageStatistics,
    Subscription,
)

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    for stage in bus.statistics().stages:
        if stage.name == name:
            return stage
    raise KeyError(name)


def assert_ledger_closed(stats: StageStatistics) -> None:
    """Nothing queued or in flight, and every admitted envelope acked or dead-lettered."""
    assert (stats.depth, stats.in_flight) == (0, 0)
    assert stats.published == stats.acked + stats.dead_lettered


async def test_subscribe_as_decorator_returns_the_function_unchanged() -> None:
    bus = Bus()

    async def handler(payload: Any) -> None:
        return None

    decorate = bus.subscribe("orders.created")
    assert decorate(handler) is handler

    @bus.subscribe("orders.updated")
    def sync_handler(payload: Any) -> None:
        return None

    assert callable(sync_handler)
    assert sync_handler.__name__ == "sync_handler"


async def test_subscribe_called_directly_returns_a_subscription() -> None:
    bus = Bus()

    async def handler(payload: Any) -> None:
        return None

    subscription = bus.subscribe("orders.created", handler, group="audit")
    assert isinstance(subscription, Subscription)


async def test_different_groups_each_get_every_message() -> None:
    audit: list[int] = []
    mail: list[int] = []
    bus = Bus()

    @bus.subscribe("orders.created")
    async def audit_order(n: int) -> None:
        audit.append(n)

    @bus.subscribe("orders.created")
    async def mail_order(n: int) -> None:
        mail.append(n)

    with anyio.fail_after(5):
        async with bus:
            receipts = [await bus.publish("orders.created", n) for n in range(10)]
            await bus.drain()

            assert audit == list(range(10))
            assert mail == list(range(10))
            assert all(len(r.accepted) == 2 for r in receipts)
            assert len(set(receipts[0].accepted)) == 2
            stages = [s for s in bus.statistics().stages if s.topic == "orders.created"]
            assert len(stages) == 2
            for stats in stages:
                assert (stats.published, stats.acked) == (10, 10)
                assert_ledger_closed(stats)


async def module_level_audit(payload: Any) -> None:
    """A handler at module level, so its default group is ``module:qualname``."""


async def test_default_group_is_module_and_qualname_of_the_handler() -> None:
    bus = Bus()
    bus.subscribe("orders", module_level_audit)

    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("orders", 1)
            await bus.drain()

    group = f"{module_level_audit.__module__}:{module_level_audit.__qualname__}"
    assert receipt.accepted == (f"orders@{group}",)
    assert stage_stats(bus, f"orders@{group}").group == group


async def test_handlers_in_the_same_group_compete_for_each_message() -> None:
    handled: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    bus = Bus()

    def make(label: str) -> Any:
        async def handle(n: int) -> None:
            handled[label].append(n)
            await anyio.lowlevel.checkpoint()

        return handle

    for label in handled:
        bus.subscribe("jobs", make(label), group="workers")

    with anyio.fail_after(5):
        async with bus:
            receipts = [await bus.publish("jobs", n) for n in range(60)]
            await bus.drain()

            assert {r.accepted for r in receipts} == {("jobs@workers",)}
            every = [n for got in handled.values() for n in got]
            assert sum(len(got) for got in handled.values()) == 60
            assert sorted(every) == list(range(60))
            stats = stage_stats(bus, "jobs@workers")
            assert (stats.published, stats.acked, stats.concurrency) == (60, 60, 3)
            assert_ledger_closed(stats)
            assert len(bus.statistics().stages) == 1


async def test_nats_wildcards_match_as_specified() -> None:
    got: set[tuple[str, str]] = set()
    patterns = {
        "exact": "orders",
        "star": "orders.*",
        "tail": "orders.>",
        "middle": "orders.*.eu",
        "lead": "*.created",
        "all": ">",
    }
    bus = Bus()

    def make(group: str) -> Any:
        async def handle(env: Envelope) -> None:
            got.add((group, env.topic))

        return handle

    for group, pattern in patterns.items():
        bus.subscribe(pattern, make(group), group=group)

    topics = ["orders", "orders.created", "orders.created.eu", "orders.created.us", "other.created"]
    with anyio.fail_after(5):
        async with bus:
            for topic in topics:
                await bus.publish(topic, None)
            await bus.drain()

    assert got == {
        ("exact", "orders"),
        ("star", "orders.created"),
        ("tail", "orders.created"),
        ("tail", "orders.created.eu"),
        ("tail", "orders.created.us"),
        ("middle", "orders.created.eu"),
        ("lead", "orders.created"),
        ("lead", "other.created"),
        *(("all", topic) for topic in topics),
    }
    assert len(bus.dead_letters) == 0


async def test_a_topic_matching_two_patterns_of_one_group_is_delivered_once() -> None:
    calls: list[tuple[str, str]] = []
    bus = Bus()

    @bus.subscribe("a.*", group="g")
    async def first(env: Envelope) -> None:
        calls.append(("first", env.topic))

    @bus.subscribe("a.>", group="g")
    async def second(env: Envelope) -> None:
        calls.append(("second", env.topic))

    with anyio.fail_after(5):
        async with bus:
            both = await bus.publish("a.b", 1)
            deep = await bus.publish("a.b.c", 2)
            await bus.drain()

            assert both.accepted == ("a.*@g",)
            assert deep.accepted == ("a.>@g",)
            # two stages, two consumers: their relative order is not defined
            assert sorted(calls) == [("first", "a.b"), ("second", "a.b.c")]
            assert stage_stats(bus, "a.*@g").acked == 1
            assert stage_stats(bus, "a.>@g").acked == 1


async def test_subscribing_after_start_takes_effect_at_once() -> None:
    handled: list[int] = []

    async def late(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(5):
        async with Bus() as bus:
            bus.subscribe("late", late, group="late")
            receipt = await bus.publish("late", 1)
            await bus.drain()

            assert receipt.accepted == ("late@late",)
            assert handled == [1]
            assert len(bus.dead_letters) == 0


async def test_a_handler_added_to_a_running_stage_competes_at_once() -> None:
    release = anyio.Event()
    first_in = anyio.Event()
    helped = anyio.Event()
    by_helper: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def slow(n: int) -> None:
        first_in.set()
        await release.wait()

    async def helper(n: int) -> None:
        by_helper.append(n)
        helped.set()

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 1)
            await first_in.wait()
            bus.subscribe("jobs", helper, group="g")
            await bus.publish("jobs", 2)
            # "slow" is still held, so only the new handler can take it
            await helped.wait()

            assert by_helper == [2]
            assert stage_stats(bus, "jobs@g").concurrency == 2
            release.set()
            await bus.drain()
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked) == (2, 2)


async def test_envelope_ids_are_unique_and_sort_in_publish_order() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            ids = [(await bus.publish("nobody.home", n)).id for n in range(200)]
    assert len(set(ids)) == 200
    assert sorted(ids) == ids


async def test_handler_annotated_with_envelope_gets_the_envelope_else_the_payload() -> None:
    envelopes: list[Envelope] = []
    payloads: list[Any] = []
    untyped: list[Any] = []
    bus = Bus()

    @bus.subscribe("orders", group="env")
    async def wants_envelope(env: Envelope) -> None:
        envelopes.append(env)

    @bus.subscribe("orders", group="payload")
    async def wants_payload(order: dict[str, int]) -> None:
        payloads.append(order)

    @bus.subscribe("orders", group="untyped")
    async def wants_anything(order):  # type: ignore[no-untyped-def]
        untyped.append(order)

    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("orders", {"id": 1}, headers={"k": "v"})
            await bus.drain()

    assert len(envelopes) == 1
    env = envelopes[0]
    assert isinstance(env, Envelope)
    assert (env.id, env.topic, env.payload, env.attempt) == (receipt.id, "orders", {"id": 1}, 1)
    assert env.headers["k"] == "v"
    assert payloads == [{"id": 1}]
    assert untyped == [{"id": 1}]


async def test_sync_handler_runs_off_the_event_loop_thread() -> None:
    threads: list[int] = []
    loop_thread = threading.get_ident()
    bus = Bus()

    @bus.subscribe("work", group="sync")
    def crunch(n: int) -> None:
        threads.append(threading.get_ident())

    with anyio.fail_after(5):
        async with bus:
            for n in range(3):
                await bus.publish("work", n)
            await bus.drain()

            assert len(threads) == 3
            assert loop_thread not in threads
            stats = stage_stats(bus, "work@sync")
            assert (stats.published, stats.acked) == (3, 3)


async def test_a_handler_failing_every_fifth_message_leaves_all_others_handled() -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=2)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        if n % 5 == 4:
            raise ValueError(f"every fifth: {n}")
        handled.append(n)

    with anyio.fail_after(5):
        async with bus:
            receipts = [await bus.publish("jobs", n) for n in range(50)]
            await bus.drain()

            assert sorted(handled) == [n for n in range(50) if n % 5 != 4]
            assert len(handled) == 40
            letters = bus.dead_letters.list()
            assert len(letters) == 10
            assert {d.reason for d in letters} == {DeadLetterReason.HANDLER_FAILED}
            failed_ids = {receipts[n].id for n in range(50) if n % 5 == 4}
            assert {d.envelope.id for d in letters} == failed_ids
            stats = stage_stats(bus, "jobs@g")
            assert (stats.published, stats.acked, stats.failed, stats.dead_lettered) == (
                50,
                40,
                10,
                10,
            )
            assert stats.acked + stats.dead_lettered == stats.published
            assert_ledger_closed(stats)

            # the stage is still alive after the failures
            await bus.publish("jobs", 100)
            await bus.drain()
            assert handled[-1] == 100
            assert stage_stats(bus, "jobs@g").acked == 41


async def test_statistics_ledger_is_exact_while_work_is_queued_and_in_flight() -> None:
    release = anyio.Event()
    both_in = anyio.Event()
    entered: list[int] = []
    bus = Bus()

    @bus.subscribe("jobs", group="g", concurrency=2, capacity=5)
    async def handle(n: int) -> None:
        entered.append(n)
        if len(entered) == 2:
            both_in.set()
        await release.wait()

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("jobs", 0)
            await bus.publish("jobs", 1)
            await both_in.wait()
            for n in range(2, 6):
                await bus.publish("jobs", n)

            busy = stage_stats(bus, "jobs@g")
            assert (busy.name, busy.topic, busy.group, busy.concurrency) == (
                "jobs@g",
                "jobs",
                "g",
                2,
            )
            assert (busy.published, busy.acked, busy.depth, busy.in_flight) == (6, 0, 4, 2)
            assert busy.published == busy.acked + busy.dead_lettered + busy.depth + busy.in_flight

            release.set()
            await bus.drain()

            done = stage_stats(bus, "jobs@g")
            assert (done.published, done.acked, done.failed, done.dead_lettered) == (6, 6, 0, 0)
            assert (done.rejected, done.dropped, done.expired, done.retried) == (0, 0, 0, 0)
            assert (done.depth, done.in_flight) == (0, 0)
            assert sorted(entered) == list(range(6))
            assert 0 <= done.latency_p50 <= done.latency_p99
            assert done.wait_p99 >= 0

            # bus-wide totals are the sums over the stages
            whole = bus.statistics()
            assert isinstance(whole.free_threaded, bool)
            for field in ("published", "acked", "failed", "dead_lettered", "rejected", "dropped"):
                assert getattr(whole, field) == sum(getattr(s, field) for s in whole.stages)


async def test_publish_before_start_raises_bus_closed_error() -> None:
    bus = Bus()
    with pytest.raises(BusClosedError):
        await bus.publish("orders", 1)
    with pytest.raises(BusClosedError):
        bus.publish_nowait("orders", 1)
    with anyio.fail_after(5):
        future = await anyio.to_thread.run_sync(bus.publish_threadsafe, "orders", 1)
        with pytest.raises(BusClosedError):
            await anyio.to_thread.run_sync(lambda: future.result(timeout=2))
    assert issubclass(BusClosedError, RuntimeError)


async def test_publish_after_close_raises_bus_closed_error() -> None:
    bus = Bus()

    @bus.subscribe("orders", group="g")
    async def handle(n: int) -> None:
        return None

    with anyio.fail_after(5):
        async with bus:
            await bus.publish("orders", 1)
        with pytest.raises(BusClosedError):
            await bus.publish("orders", 2)
        with pytest.raises(BusClosedError):
            bus.publish_nowait("orders", 3)
        future = await anyio.to_thread.run_sync(bus.publish_threadsafe, "orders", 4)
        with pytest.raises(BusClosedError):
            await anyio.to_thread.run_sync(lambda: future.result(timeout=2))
    assert stage_stats(bus, "orders@g").published == 1


def test_configuration_error_is_a_value_error() -> None:
    assert issubclass(ConfigurationError, ValueError)


def test_capacity_below_one_is_a_configuration_error() -> None:
    bus = Bus()

    async def handler(payload: Any) -> None:
        return None

    with pytest.raises(ConfigurationError, match="capacity"):
        bus.subscribe("orders", handler, capacity=0)


def test_concurrency_below_one_is_a_configuration_error() -> None:
    bus = Bus()

    async def handler(payload: Any) -> None:
        return None

    with pytest.raises(ConfigurationError, match="concurrency"):
        bus.subscribe("orders", handler, concurrency=0)


@pytest.mark.parametrize("pattern", ["", "a..b", "a.>.b", "a*", ".a", "a.", "a.b>"])
def test_malformed_pattern_is_a_configuration_error(pattern: str) -> None:
    bus = Bus()

    async def handler(payload: Any) -> None:
        return None

    with pytest.raises(ConfigurationError):
        bus.subscribe(pattern, handler)


def test_non_callable_handler_is_a_configuration_error() -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError):
        bus.subscribe("orders", 42)  # type: ignore[call-overload]


def test_same_pattern_and_group_with_different_capacity_is_a_configuration_error() -> None:
    bus = Bus()

    async def one(payload: Any) -> None:
        return None

    async def two(payload: Any) -> None:
        return None

    bus.subscribe("orders", one, group="g", capacity=10)
    with pytest.raises(ConfigurationError):
        bus.subscribe("orders", two, group="g", capacity=20)


def test_same_pattern_and_group_with_different_backpressure_is_a_configuration_error() -> None:
    bus = Bus()

    async def one(payload: Any) -> None:
        return None

    async def two(payload: Any) -> None:
        return None

    bus.subscribe("orders", one, group="g", backpressure=Backpressure.BLOCK)
    with pytest.raises(ConfigurationError):
        bus.subscribe("orders", two, group="g", backpressure=Backpressure.REJECT)


async def test_same_pattern_and_group_with_the_same_settings_share_one_stage() -> None:
    bus = Bus()

    async def one(payload: Any) -> None:
        return None

    async def two(payload: Any) -> None:
        return None

    bus.subscribe("orders", one, group="g", capacity=10, concurrency=2)
    bus.subscribe("orders", two, group="g", capacity=10, concurrency=3)
    with anyio.fail_after(5):
        async with bus:
            stats = bus.statistics()
            assert [s.name for s in stats.stages] == ["orders@g"]
            assert stats.stages[0].concurrency == 5
