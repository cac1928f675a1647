"""``Bus.publish_many``: one envelope per payload, receipts in order, one yield per call."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from asyncbus import (
    Backpressure,
    Bus,
    BusClosedError,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    Priority,
    PublishTimeout,
)
from asyncbus.testing import capture

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


def _ledger(bus: Bus, name: str) -> tuple[int, int, int, int, int, int]:
    stage = bus.statistics().stage(name)
    ends = stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
    assert stage.published == ends, stage
    return (
        stage.published,
        stage.acked,
        stage.dead_lettered,
        stage.rejected,
        stage.dropped,
        stage.abandoned,
    )


async def test_each_payload_is_handled_once_in_order_with_a_receipt_each(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.one", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        receipts = await bus.publish_many("many.one", range(50))
        await bus.drain()
    assert handled == list(range(50))
    assert [receipt.accepted for receipt in receipts] == [("many.one@g",)] * 50
    assert all(receipts)
    ids = [receipt.id for receipt in receipts]
    assert ids == sorted(ids) and len(set(ids)) == 50
    assert _ledger(bus, "many.one@g") == (50, 50, 0, 0, 0, 0)
    assert_settled(bus)


async def test_every_envelope_carries_the_same_options_and_a_fresh_id() -> None:
    seen: list[Envelope] = []
    bus = Bus(name="maker")

    @bus.subscribe("many.options", group="g")
    async def handle(env: Envelope) -> None:
        seen.append(env)

    async with bus:
        receipts = await bus.publish_many(
            "many.options",
            ["a", "b", "c"],
            headers={"k": "v"},
            ttl=60,
            slip=["many.next"],
            key="user-1",
            priority=Priority.HIGH,
        )
        await bus.drain()
    assert [env.payload for env in seen] == ["a", "b", "c"]
    assert [env.id for env in seen] == [receipt.id for receipt in receipts]
    assert {env.correlation_id for env in seen} == {receipt.id for receipt in receipts}
    for env in seen:
        assert env.headers["k"] == "v"
        assert env.headers["asyncbus-key"] == "user-1"
        assert env.headers["asyncbus-priority"] == str(int(Priority.HIGH))
        assert (env.ttl, env.slip, env.attempt, env.sender) == (60, ("many.next",), 1, "maker")
        assert env.causation_id is None and env.correlation_id == env.id


async def test_fan_out_gives_every_group_every_envelope_once_and_in_order(
    assert_settled: Callable[[Bus], None],
) -> None:
    got: dict[str, list[int]] = {"a": [], "b": []}
    bus = Bus()

    @bus.subscribe("many.fan.x", group="a")
    async def first(n: int) -> None:
        got["a"].append(n)

    # The same group on a second matching pattern: still once for the group.
    bus.subscribe("many.fan.*", first, group="a")

    @bus.subscribe("many.fan.*", group="b")
    async def second(n: int) -> None:
        got["b"].append(n)

    async with bus:
        receipts = await bus.publish_many("many.fan.x", range(20))
        await bus.drain()
    assert got == {"a": list(range(20)), "b": list(range(20))}
    assert {receipt.accepted for receipt in receipts} == {("many.fan.x@a", "many.fan.*@b")}
    assert _ledger(bus, "many.fan.x@a")[:2] == (20, 20)
    assert _ledger(bus, "many.fan.*@a")[:2] == (0, 0)
    assert _ledger(bus, "many.fan.*@b")[:2] == (20, 20)
    assert_settled(bus)


async def test_competing_consumers_share_a_batch_each_envelope_once() -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.work", group="workers", concurrency=4)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        handled.append(n)

    async with bus:
        for start in range(0, 400, 100):
            await bus.publish_many("many.work", range(start, start + 100))
        await bus.drain()
    assert sorted(handled) == list(range(400))
    assert _ledger(bus, "many.work@workers") == (400, 400, 0, 0, 0, 0)


async def test_a_generator_is_read_once_and_empty_payloads_publish_nothing() -> None:
    handled: list[int] = []
    reads: list[int] = []
    bus = Bus()

    @bus.subscribe("many.gen", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    def numbers() -> Iterator[int]:
        for n in range(5):
            reads.append(n)
            yield n

    async with bus:
        receipts = await bus.publish_many("many.gen", numbers())
        assert await bus.publish_many("many.gen", []) == []
        assert await bus.publish_many("many.gen", iter(())) == []
        await bus.drain()
    assert reads == handled == [0, 1, 2, 3, 4]
    assert len(receipts) == 5
    assert _ledger(bus, "many.gen@g") == (5, 5, 0, 0, 0, 0)


async def test_even_an_empty_publish_many_needs_an_open_bus() -> None:
    bus = Bus()
    with pytest.raises(BusClosedError, match="not started"):
        await bus.publish_many("many.closed", [])
    async with bus:
        pass
    with pytest.raises(BusClosedError):
        await bus.publish_many("many.closed", [])
    with pytest.raises(BusClosedError):
        await bus.publish_many("many.closed", [1, 2])


@pytest.mark.parametrize(
    ("payloads", "kind"),
    [
        ("abc", "str"),
        (b"abc", "bytes"),
        (bytearray(b"ab"), "bytearray"),
        ({"a": 1}, "dict"),
        (3, "int"),
    ],
)
async def test_one_payload_where_many_are_expected_is_refused(payloads: Any, kind: str) -> None:
    bus = Bus()

    @bus.subscribe("many.refused", group="g")
    async def handle(_: object) -> None:
        pass

    async with bus:
        with pytest.raises(
            ConfigurationError, match=f"payloads must be an iterable of payloads, got {kind}$"
        ):
            await bus.publish_many("many.refused", payloads)
    assert bus.statistics().stage("many.refused@g").published == 0


@pytest.mark.parametrize(
    ("topic", "options", "match"),
    [
        ("many..bad", {}, "topic|token"),
        ("many.opts", {"ttl": -1}, "ttl"),
        ("many.opts", {"timeout": -1}, "timeout"),
        ("many.opts", {"priority": 7}, "priority"),
        ("many.opts", {"headers": {"k": 1}}, "header"),
        ("many.opts", {"slip": ["bad..hop"]}, "token|topic"),
    ],
)
async def test_bad_options_are_refused_once_at_the_door_and_publish_nothing(
    topic: str, options: dict[str, Any], match: str
) -> None:
    reads: list[int] = []
    bus = Bus()

    @bus.subscribe("many.opts", group="g")
    async def handle(_: object) -> None:
        pass

    def numbers() -> Iterator[int]:
        for n in range(3):
            reads.append(n)
            yield n

    async with bus:
        with pytest.raises(ConfigurationError, match=match):
            await bus.publish_many(topic, numbers(), **options)
    assert reads == []
    assert bus.statistics().stage("many.opts@g").published == 0


async def test_a_full_block_stage_admits_the_batch_as_room_appears_in_order(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.block", group="g", capacity=2)
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        receipts = await bus.publish_many("many.block", range(30))
        await bus.drain()
    assert handled == list(range(30))
    assert all(receipt.accepted == ("many.block@g",) for receipt in receipts)
    assert _ledger(bus, "many.block@g") == (30, 30, 0, 0, 0, 0)
    assert_settled(bus)


async def test_the_timeout_is_one_deadline_and_the_error_carries_the_receipts_so_far(
    assert_settled: Callable[[Bus], None],
) -> None:
    release = anyio.Event()
    entered = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.timeout", group="g", capacity=3)
    async def handle(n: int) -> None:
        entered.set()
        await release.wait()
        handled.append(n)

    async with bus:
        await bus.publish("many.timeout", -1)  # taken by the consumer, which waits
        await entered.wait()
        with pytest.raises(PublishTimeout) as caught:
            await bus.publish_many("many.timeout", range(10), timeout=0.05)
        error = caught.value
        assert [receipt.accepted for receipt in error.receipts] == [("many.timeout@g",)] * 3
        assert error.receipt.accepted == () and error.receipt.id not in {
            receipt.id for receipt in error.receipts
        }
        assert _ledger(bus, "many.timeout@g")[0] == 4  # the -1 and the three before it
        release.set()
        await bus.drain()
    assert handled == [-1, 0, 1, 2]
    assert _ledger(bus, "many.timeout@g") == (4, 4, 0, 0, 0, 0)
    assert_settled(bus)


async def test_the_timeout_bounds_the_whole_call_when_no_room_ever_comes(
    assert_settled: Callable[[Bus], None],
) -> None:
    release = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("many.deadline", group="g", capacity=2)
    async def handle(n: int) -> None:
        entered.set()
        await release.wait()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("many.deadline", -1)  # taken by the consumer, which waits
            await entered.wait()
            await bus.publish_many("many.deadline", [0, 1])  # the stage is full now
            started = anyio.current_time()
            with pytest.raises(PublishTimeout) as caught:
                await bus.publish_many("many.deadline", range(2, 12), timeout=0.5)
            waited = anyio.current_time() - started
            # One deadline for the call: not a wait for a run, then another for one envelope.
            assert 0.5 <= waited < 0.9, waited
            assert (caught.value.receipts, caught.value.receipt.accepted) == ([], ())
            release.set()
            await bus.drain()
    assert _ledger(bus, "many.deadline@g") == (3, 3, 0, 0, 0, 0)
    assert_settled(bus)


async def test_a_reject_stage_lists_itself_in_the_receipts_of_what_it_refused(
    assert_settled: Callable[[Bus], None],
) -> None:
    release = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("many.reject", group="g", capacity=2, backpressure=Backpressure.REJECT)
    async def handle(n: int) -> None:
        entered.set()
        await release.wait()

    async with bus:
        await bus.publish("many.reject", -1)
        await entered.wait()
        receipts = await bus.publish_many("many.reject", range(5))
        release.set()
        await bus.drain()
    assert [receipt.accepted for receipt in receipts] == [("many.reject@g",)] * 2 + [()] * 3
    assert [receipt.rejected for receipt in receipts] == [()] * 2 + [("many.reject@g",)] * 3
    assert [bool(receipt) for receipt in receipts] == [True, True, False, False, False]
    assert _ledger(bus, "many.reject@g") == (3, 3, 0, 3, 0, 0)
    assert_settled(bus)


@pytest.mark.parametrize("policy", [Backpressure.DROP_NEWEST, Backpressure.DROP_OLDEST])
async def test_drop_stages_dead_letter_what_they_drop_per_envelope(
    policy: Backpressure, assert_settled: Callable[[Bus], None]
) -> None:
    release = anyio.Event()
    entered = anyio.Event()
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.drop", group="g", capacity=2, backpressure=policy)
    async def handle(n: int) -> None:
        entered.set()
        await release.wait()
        handled.append(n)

    async with bus:
        await bus.publish("many.drop", -1)
        await entered.wait()
        receipts = await bus.publish_many("many.drop", range(5))
        release.set()
        await bus.drain()
    dropped = [entry.envelope.payload for entry in bus.dead_letters.list(reason="dropped")]
    if policy is Backpressure.DROP_NEWEST:
        assert [receipt.dropped for receipt in receipts] == [()] * 2 + [("many.drop@g",)] * 3
        assert handled == [-1, 0, 1]
        assert dropped == [2, 3, 4]
    else:
        assert all(receipt.accepted == ("many.drop@g",) for receipt in receipts)
        assert handled == [-1, 3, 4]
        assert dropped == [0, 1, 2]
    assert _ledger(bus, "many.drop@g") == (6, 3, 3, 0, 3, 0)
    assert_settled(bus)


async def test_with_no_subscriber_each_envelope_is_a_no_subscribers_dead_letter() -> None:
    bus = Bus()
    async with bus:
        receipts = await bus.publish_many("many.nobody", ["a", "b", "c"])
    entries = bus.dead_letters.list(reason=DeadLetterReason.NO_SUBSCRIBERS)
    assert [entry.envelope.id for entry in entries] == [receipt.id for receipt in receipts]
    assert [entry.envelope.payload for entry in entries] == ["a", "b", "c"]
    assert all(receipt.accepted == () for receipt in receipts)


async def test_published_by_a_handler_each_continues_its_conversation() -> None:
    seen: list[Envelope] = []
    bus = Bus()

    @bus.subscribe("many.start", group="g")
    async def start(env: Envelope) -> None:
        await bus.publish_many("many.next", [1, 2])

    @bus.subscribe("many.next", group="g")
    async def after(env: Envelope) -> None:
        seen.append(env)

    async with bus:
        first = await bus.publish("many.start", None)
        await bus.drain()
    assert [env.payload for env in seen] == [1, 2]
    assert {(env.correlation_id, env.causation_id) for env in seen} == {(first.id, first.id)}


async def test_capture_and_observers_see_every_envelope() -> None:
    bus = Bus()

    @bus.subscribe("many.seen", group="g")
    async def handle(_: object) -> None:
        pass

    async with bus:
        with capture(bus) as captured:
            receipts = await bus.publish_many("many.seen", [1, 2, 3])
            await bus.drain()
    assert captured.payloads("many.seen") == [1, 2, 3]
    assert [env.id for env in captured.envelopes()] == [receipt.id for receipt in receipts]
    assert _ledger(bus, "many.seen@g") == (3, 3, 0, 0, 0, 0)


async def test_capture_sees_a_batch_that_waits_for_room_only_as_far_as_it_went() -> None:
    release = anyio.Event()
    entered = anyio.Event()
    bus = Bus()

    @bus.subscribe("many.partial", group="g", capacity=1)
    async def handle(_: object) -> None:
        entered.set()
        await release.wait()

    async with bus:
        await bus.publish("many.partial", 0)
        await entered.wait()
        with capture(bus) as captured:
            with pytest.raises(PublishTimeout) as caught:
                await bus.publish_many("many.partial", [1, 2, 3], timeout=0.05)
            release.set()
            await bus.drain()
    # 1 queued, 2 timed out (observed: it was routed), 3 never published
    assert captured.payloads() == [1, 2]
    assert len(caught.value.receipts) == 1


async def test_from_another_thread_it_is_refused_and_publishes_nothing(
    anyio_backend: tuple[str, dict[str, Any]],
) -> None:
    name, options = anyio_backend
    refused: list[BaseException] = []
    bus = Bus()

    @bus.subscribe("many.thread", group="g")
    async def handle(_: object) -> None:
        pass

    def elsewhere() -> None:
        try:
            anyio.run(
                bus.publish_many, "many.thread", [1, 2], backend=name, backend_options=options
            )
        except RuntimeError as error:
            refused.append(error)

    async with bus:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        await anyio.to_thread.run_sync(thread.join)
        await bus.drain()
    assert len(refused) == 1 and "publish_threadsafe" in str(refused[0])
    assert bus.statistics().stage("many.thread@g").published == 0


async def test_refused_during_aclose_from_outside_and_allowed_from_handlers(
    assert_settled: Callable[[Bus], None],
) -> None:
    outcome: list[object] = []
    entered = anyio.Event()
    gate = anyio.Event()
    bus = Bus()

    @bus.subscribe("many.close", group="g")
    async def handle(_: object) -> None:
        entered.set()
        await gate.wait()
        outcome.append(await bus.publish_many("many.after", [1, 2]))

    @bus.subscribe("many.after", group="g")
    async def after(n: int) -> None:
        outcome.append(n)

    async with anyio.create_task_group() as tg, bus:
        await bus.publish("many.close", None)
        await entered.wait()

        async def close() -> None:
            await bus.aclose()

        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(BusClosedError):
            await bus.publish_many("many.after", [3])
        gate.set()
    assert outcome[1:] == [1, 2] or outcome[2:] == [1, 2]
    assert len(outcome) == 3
    assert _ledger(bus, "many.after@g") == (2, 2, 0, 0, 0, 0)
    assert_settled(bus)


@pytest.mark.timeout(20)
async def test_a_batch_cut_off_by_the_stop_while_blocked_admits_nothing_more(
    assert_settled: Callable[[Bus], None],
) -> None:
    never = anyio.Event()
    entered = anyio.Event()
    errors: list[BusClosedError] = []
    bus = Bus()

    @bus.subscribe("many.cut", group="g", capacity=2)
    async def handle(_: object) -> None:
        entered.set()
        await never.wait()

    async def publish_blocked() -> None:
        with pytest.raises(BusClosedError) as caught:
            await bus.publish_many("many.cut", range(10))
        errors.append(caught.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            first = await bus.publish("many.cut", -1)
            await entered.wait()
            tg.start_soon(publish_blocked)
            await anyio.wait_all_tasks_blocked()
            report = await bus.aclose(timeout=0.05)

    [error] = errors
    assert len(error.receipts) == 2  # 0 and 1 queued; 2 waited for room, 3.. never sent
    assert error.receipt is not None and error.receipt.accepted == ()
    assert sorted(report.abandoned) == sorted([first.id, *(r.id for r in error.receipts)])
    assert _ledger(bus, "many.cut@g") == (3, 0, 0, 0, 0, 3)
    assert_settled(bus)


async def test_a_batch_holding_room_at_one_stage_while_another_stays_full_is_cut_off_cleanly(
    assert_settled: Callable[[Bus], None],
) -> None:
    fast_gate = anyio.Event()
    never = anyio.Event()
    entered = {"fast": anyio.Event(), "slow": anyio.Event()}
    handled: list[int] = []
    errors: list[BusClosedError] = []
    bus = Bus()

    @bus.subscribe("many.fan", group="fast", capacity=2)
    async def fast(n: int) -> None:
        entered["fast"].set()
        await fast_gate.wait()
        handled.append(n)

    @bus.subscribe("many.fan", group="slow", capacity=2)
    async def slow(_: int) -> None:
        entered["slow"].set()
        await never.wait()

    async def publish_blocked() -> None:
        with pytest.raises(BusClosedError) as caught:
            await bus.publish_many("many.fan", range(10))
        errors.append(caught.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            await bus.publish("many.fan", -1)
            await entered["fast"].wait()
            await entered["slow"].wait()
            tg.start_soon(publish_blocked)  # 0 and 1 fill both stages; it waits at both
            await anyio.wait_all_tasks_blocked()
            fast_gate.set()  # "fast" frees its room and hands it to the batch, which
            await anyio.wait_all_tasks_blocked()  # holds it while "slow" stays full
            assert handled == [-1, 0, 1]
            held = bus.statistics().stage("many.fan@fast")
            assert (held.published, held.depth, held.in_flight) == (3, 0, 0)
            await bus.aclose(timeout=0.05)

    [error] = errors
    assert [receipt.accepted for receipt in error.receipts] == [
        ("many.fan@fast", "many.fan@slow")
    ] * 2
    assert error.receipt is not None and error.receipt.accepted == ()
    assert _ledger(bus, "many.fan@fast") == (3, 3, 0, 0, 0, 0)
    assert _ledger(bus, "many.fan@slow") == (3, 0, 0, 0, 0, 3)
    assert_settled(bus)


async def test_a_controlled_stage_takes_a_batch_in_priority_lanes() -> None:
    handled: list[int] = []
    bus = Bus()
    from asyncbus import Admission

    @bus.subscribe("many.lanes", group="g", admission=Admission())
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        await bus.publish_many("many.lanes", range(20), priority=Priority.LOW)
        await bus.drain()
    assert handled == list(range(20))
    assert _ledger(bus, "many.lanes@g") == (20, 20, 0, 0, 0, 0)


async def test_a_batch_waiting_for_room_takes_it_in_runs_and_keeps_its_order(
    assert_settled: Callable[[Bus], None],
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("many.runs", group="g", capacity=8)
    async def handle(n: int) -> None:
        await anyio.lowlevel.checkpoint()
        handled.append(n)

    @bus.subscribe("many.runs", group="other", capacity=3)
    async def other(n: int) -> None:
        pass

    async with bus, anyio.create_task_group() as tg:
        # Two batches and single publishes compete for the same full stages.
        tg.start_soon(bus.publish_many, "many.runs", range(0, 100))
        tg.start_soon(bus.publish_many, "many.runs", range(100, 200))
        for n in range(200, 220):
            await bus.publish("many.runs", n)
    assert sorted(handled) == list(range(220))
    for start, stop in ((0, 100), (100, 200), (200, 220)):
        assert [n for n in handled if start <= n < stop] == list(range(start, stop))
    assert _ledger(bus, "many.runs@g") == (220, 220, 0, 0, 0, 0)
    assert _ledger(bus, "many.runs@other") == (220, 220, 0, 0, 0, 0)
    assert_settled(bus)


async def test_at_its_deadline_a_batch_takes_what_room_there_is_then_times_out(
    assert_settled: Callable[[Bus], None],
) -> None:
    gates = {n: anyio.Event() for n in range(-1, 10)}
    taken: list[int] = []
    bus = Bus()

    @bus.subscribe("many.room", group="g", capacity=4)
    async def handle(n: int) -> None:
        taken.append(n)
        await gates[n].wait()

    async with bus:
        await bus.publish("many.room", -1)
        await anyio.wait_all_tasks_blocked()
        await bus.publish_many("many.room", range(4))  # the stage is full now
        async with anyio.create_task_group() as tg:

            async def late() -> None:
                with pytest.raises(PublishTimeout) as caught:
                    await bus.publish_many("many.room", range(4, 10), timeout=0.2)
                outcome.append(caught.value)

            outcome: list[PublishTimeout] = []
            tg.start_soon(late)
            await anyio.wait_all_tasks_blocked()
            gates[-1].set()  # one place frees up: the batch waits for a run of two
            await anyio.wait_all_tasks_blocked()
            assert taken == [-1, 0]
        [error] = outcome
        # At the deadline the one free place took 4; 5 timed out; 6.. never published.
        assert len(error.receipts) == 1 and error.receipts[0].accepted == ("many.room@g",)
        for gate in gates.values():
            gate.set()
        await bus.drain()
    assert taken == [-1, 0, 1, 2, 3, 4]
    assert _ledger(bus, "many.room@g") == (6, 6, 0, 0, 0, 0)
    assert_settled(bus)
