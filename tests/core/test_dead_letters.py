"""The dead-letter queue: reasons, `$deadletter`, bounds, expiry, list, get, purge, replay."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import anyio
import anyio.lowlevel
import pytest

from asyncbus import (
    DEADLETTER_TOPIC,
    HEADER_REPLAYED,
    Bus,
    BusClosedError,
    DeadLetter,
    DeadLetterReason,
    Envelope,
    Receipt,
    Reject,
    Retry,
    StageStatistics,
)
from asyncbus._dead_letters import DeadLetterQueue, dead_letter_key

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    """Return the statistics of the stage called ``name``."""
    for stage in bus.statistics().stages:
        if stage.name == name:
            return stage
    raise KeyError(name)


async def test_publish_without_subscribers_is_dead_lettered_at_once() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            receipt = await bus.publish("nobody.home", {"n": 1}, headers={"k": "v"})

            # no drain, no checkpoint: it is already there
            assert receipt.accepted == ()
            assert len(bus.dead_letters) == 1
            letter = bus.dead_letters.get(receipt.id)
            assert letter is not None
            assert letter.reason == DeadLetterReason.NO_SUBSCRIBERS
            assert letter.reason == "no_subscribers"
            assert letter.stage is None
            assert letter.envelope.id == receipt.id
            assert letter.envelope.topic == "nobody.home"
            assert letter.envelope.payload == {"n": 1}
            assert letter.envelope.headers["k"] == "v"


async def test_deadletter_subscriber_receives_dead_letter_payloads() -> None:
    letters: list[DeadLetter] = []
    bus = Bus()

    @bus.subscribe(DEADLETTER_TOPIC, group="watch")
    async def watch(letter: DeadLetter) -> None:
        letters.append(letter)

    @bus.subscribe("orders", group="broken")
    async def broken(payload: int) -> None:
        raise ValueError(f"boom {payload}")

    with anyio.fail_after(5):
        async with bus:
            lost = await bus.publish("nobody.home", 1)
            failed = await bus.publish("orders", 7)
            await bus.drain()

            assert all(isinstance(letter, DeadLetter) for letter in letters)
            assert sorted((d.envelope.id, d.reason, d.stage) for d in letters) == sorted(
                [
                    (lost.id, DeadLetterReason.NO_SUBSCRIBERS, None),
                    (failed.id, DeadLetterReason.HANDLER_FAILED, "orders@broken"),
                ]
            )
            by_id = {d.envelope.id: d for d in letters}
            assert by_id[failed.id].error is not None
            assert "ValueError" in by_id[failed.id].error
            assert "boom 7" in by_id[failed.id].error
            assert by_id[failed.id].attempts == 1
            # the $deadletter deliveries are not dead letters themselves
            assert len(bus.dead_letters) == 2
            stats = stage_stats(bus, f"{DEADLETTER_TOPIC}@watch")
            assert (stats.published, stats.acked, stats.dead_lettered) == (2, 2, 0)


async def test_a_failing_deadletter_handler_adds_nothing_to_the_queue() -> None:
    calls: list[str] = []
    bus = Bus()

    @bus.subscribe(DEADLETTER_TOPIC, group="watch")
    async def watch(letter: DeadLetter) -> None:
        calls.append(letter.envelope.id)
        raise RuntimeError("the watcher is broken too")

    @bus.subscribe(DEADLETTER_TOPIC, group="refuse")
    async def refuse(letter: DeadLetter) -> None:
        calls.append(letter.envelope.id)
        raise Reject("not today")

    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("nobody.home", 1)
            await bus.drain()

            assert calls == [receipt.id, receipt.id]
            assert [d.envelope.id for d in bus.dead_letters.list()] == [receipt.id]
            assert len(bus.dead_letters) == 1
            for name in (f"{DEADLETTER_TOPIC}@watch", f"{DEADLETTER_TOPIC}@refuse"):
                stats = stage_stats(bus, name)
                assert stats.published == 1
                assert (stats.depth, stats.in_flight) == (0, 0)
                assert stats.published == stats.acked + stats.dead_lettered


async def test_a_failing_catch_all_subscriber_never_dead_letters_a_dead_letter() -> None:
    seen: list[object] = []
    bus = Bus()

    @bus.subscribe(">", group="everything")
    async def everything(payload: object) -> None:
        seen.append(payload)
        raise RuntimeError("fails on everything")

    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("orders", 1)
            # must settle: a dead letter never begets another one, even through ">"
            await bus.drain()

            assert seen[0] == 1
            assert [d.envelope.id for d in bus.dead_letters.list()] == [receipt.id]
            assert len(bus.dead_letters) == 1
            stats = stage_stats(bus, ">@everything")
            assert (stats.depth, stats.in_flight) == (0, 0)


async def test_publishing_to_deadletter_without_subscribers_adds_nothing() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            receipt = await bus.publish(DEADLETTER_TOPIC, "a letter nobody reads")
            await bus.drain()

            assert receipt.accepted == ()
            assert len(bus.dead_letters) == 0
            assert bus.dead_letters.list() == []
            assert bus.dead_letters.get(receipt.id) is None


async def test_dead_letter_queue_is_bounded_and_evicts_the_oldest() -> None:
    with anyio.fail_after(5):
        async with Bus(dead_letter_maxlen=3) as bus:
            receipts = [await bus.publish("nobody.home", n) for n in range(5)]

            assert len(bus.dead_letters) == 3
            assert [d.envelope.id for d in bus.dead_letters.list()] == [r.id for r in receipts[2:]]
            assert bus.dead_letters.get(receipts[0].id) is None
            assert bus.dead_letters.get(receipts[1].id) is None


async def test_dead_letters_expire_after_the_dead_letter_ttl() -> None:
    with anyio.fail_after(5):
        async with Bus(dead_letter_ttl=0.05) as bus:
            receipt = await bus.publish("nobody.home", 1)
            assert len(bus.dead_letters) == 1
            assert bus.dead_letters.get(receipt.id) is not None

            # waiting for the clock, not for work
            await anyio.sleep(0.12)

            assert len(bus.dead_letters) == 0
            assert bus.dead_letters.list() == []
            assert bus.dead_letters.get(receipt.id) is None
            fresh = await bus.publish("nobody.home", 2)
            assert [d.envelope.id for d in bus.dead_letters.list()] == [fresh.id]


async def test_list_filters_by_reason_and_topic() -> None:
    bus = Bus()

    @bus.subscribe("b.fail", group="grp")
    async def fail(payload: int) -> None:
        raise ValueError("boom")

    @bus.subscribe("c.rej", group="grp")
    async def refuse(payload: int) -> None:
        raise Reject("not for me")

    with anyio.fail_after(5):
        async with bus:
            lost_a = await bus.publish("a.x", 1)
            failed = await bus.publish("b.fail", 2)
            refused = await bus.publish("c.rej", 3)
            lost_b = await bus.publish("a.y", 4)
            await bus.drain()

            def ids(letters: list[DeadLetter]) -> list[str]:
                return [d.envelope.id for d in letters]

            assert len(bus.dead_letters) == 4
            assert sorted(ids(bus.dead_letters.list())) == sorted(
                [lost_a.id, failed.id, refused.id, lost_b.id]
            )
            assert ids(bus.dead_letters.list(reason=DeadLetterReason.NO_SUBSCRIBERS)) == [
                lost_a.id,
                lost_b.id,
            ]
            assert ids(bus.dead_letters.list(reason="no_subscribers")) == [lost_a.id, lost_b.id]
            assert ids(bus.dead_letters.list(reason=DeadLetterReason.HANDLER_FAILED)) == [failed.id]
            assert ids(bus.dead_letters.list(reason=DeadLetterReason.REJECTED)) == [refused.id]
            assert ids(bus.dead_letters.list(topic="a.x")) == [lost_a.id]
            assert ids(bus.dead_letters.list(topic="b.fail")) == [failed.id]
            assert ids(bus.dead_letters.list(reason="no_subscribers", topic="a.y")) == [lost_b.id]
            assert bus.dead_letters.list(reason="handler_failed", topic="a.x") == []
            assert bus.dead_letters.list(reason=DeadLetterReason.EXPIRED) == []

            failed_letter = bus.dead_letters.get(failed.id)
            assert failed_letter is not None
            assert failed_letter.stage == "b.fail@grp"
            assert failed_letter.attempts == 1
            assert failed_letter.error is not None
            assert "ValueError" in failed_letter.error
            assert "boom" in failed_letter.error
            refused_letter = bus.dead_letters.get(refused.id)
            assert refused_letter is not None
            assert refused_letter.stage == "c.rej@grp"
            assert refused_letter.reason == DeadLetterReason.REJECTED


async def test_get_returns_the_entry_by_envelope_id() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            first = await bus.publish("nobody.home", "first")
            second = await bus.publish("nobody.home", "second")

            got = bus.dead_letters.get(second.id)
            assert got is not None
            assert got.envelope.id == second.id
            assert got.envelope.payload == "second"
            other = bus.dead_letters.get(first.id)
            assert other is not None
            assert other.envelope.payload == "first"
            assert bus.dead_letters.purge(first.id) == 1
            assert bus.dead_letters.get(first.id) is None


async def test_purge_removes_the_given_ids_or_everything() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            receipts = [await bus.publish("nobody.home", n) for n in range(4)]

            assert bus.dead_letters.purge(receipts[0].id, receipts[2].id) == 2
            assert [d.envelope.id for d in bus.dead_letters.list()] == [
                receipts[1].id,
                receipts[3].id,
            ]
            assert bus.dead_letters.purge(receipts[0].id) == 0
            assert bus.dead_letters.purge() == 2
            assert len(bus.dead_letters) == 0
            assert bus.dead_letters.list() == []


async def test_replay_reruns_the_handler_with_attempt_one_and_removes_the_entry() -> None:
    seen: list[Envelope] = []
    healthy = False
    bus = Bus()

    @bus.subscribe(
        "orders",
        group="flaky",
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
    )
    async def flaky(env: Envelope) -> None:
        seen.append(env)
        if not healthy:
            raise ValueError("database down")

    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("orders", {"id": 1})
            await bus.drain()

            assert [env.attempt for env in seen] == [1, 2]
            letter = bus.dead_letters.get(receipt.id)
            assert letter is not None
            assert (letter.reason, letter.stage, letter.attempts) == (
                DeadLetterReason.HANDLER_FAILED,
                "orders@flaky",
                2,
            )
            assert HEADER_REPLAYED not in seen[0].headers

            healthy = True
            await bus.dead_letters.replay(receipt.id)
            await bus.drain()

            assert [env.attempt for env in seen] == [1, 2, 1]
            replayed = seen[-1]
            assert replayed.id == receipt.id
            assert replayed.payload == {"id": 1}
            assert HEADER_REPLAYED in replayed.headers
            assert bus.dead_letters.get(receipt.id) is None
            assert len(bus.dead_letters) == 0
            stats = stage_stats(bus, "orders@flaky")
            assert (stats.published, stats.acked, stats.dead_lettered, stats.retried) == (
                2,
                1,
                1,
                1,
            )
            assert (stats.depth, stats.in_flight) == (0, 0)


async def test_replay_of_a_no_subscribers_letter_goes_to_its_topic() -> None:
    seen: list[Envelope] = []

    async def late(env: Envelope) -> None:
        seen.append(env)

    with anyio.fail_after(5):
        async with Bus() as bus:
            receipt = await bus.publish("late.topic", "hello")
            assert bus.dead_letters.get(receipt.id) is not None

            bus.subscribe("late.topic", late, group="late")
            await bus.dead_letters.replay(receipt.id)
            await bus.drain()

            assert [env.id for env in seen] == [receipt.id]
            assert seen[0].attempt == 1
            assert seen[0].payload == "hello"
            assert HEADER_REPLAYED in seen[0].headers
            assert len(bus.dead_letters) == 0
            stats = stage_stats(bus, "late.topic@late")
            assert (stats.published, stats.acked, stats.dead_lettered) == (1, 1, 0)


async def test_replay_and_purge_take_the_entries_themselves() -> None:
    seen: list[Envelope] = []

    async def late(env: Envelope) -> None:
        seen.append(env)

    with anyio.fail_after(5):
        async with Bus() as bus:
            first = await bus.publish("late.topic", 1)
            second = await bus.publish("late.topic", 2)
            bus.subscribe("late.topic", late, group="late")
            dead_first, dead_second = bus.dead_letters.list()

            await bus.dead_letters.replay(dead_first)
            await bus.drain()
            assert [env.id for env in seen] == [first.id]
            assert bus.dead_letters.purge(dead_second) == 1
            assert bus.dead_letters.get(second.id) is None
            with pytest.raises(TypeError, match=r"replay\(\) takes envelope ids"):
                await bus.dead_letters.replay(42)  # type: ignore[arg-type]
            assert len(bus.dead_letters) == 0


def _charge(amount: int) -> None:
    raise ValueError(f"cannot charge {amount}")


async def test_error_is_type_and_message_and_the_traceback_is_kept_beside_it() -> None:
    bus = Bus()

    @bus.subscribe("charges", retry=Retry(max_attempts=2, backoff=0))
    async def charge(amount: int) -> None:
        _charge(amount)

    @bus.subscribe("refunds")
    async def refund(amount: int) -> None:
        raise Reject("refunds are closed")

    async with bus:
        await bus.publish("charges", 5)
        await bus.publish("refunds", 5)
        await bus.drain()
    [failed] = bus.dead_letters.list(reason=DeadLetterReason.HANDLER_FAILED)
    assert (failed.error, failed.attempts) == ("ValueError: cannot charge 5", 2)
    assert failed.traceback is not None
    frames = [line for line in failed.traceback.splitlines() if line.startswith("  File ")]
    assert [line.rsplit(", in ", 1)[1] for line in frames] == ["charge", "_charge"]
    assert all(__file__ in line for line in frames)  # no asyncbus frame among them
    assert "raise ValueError" in failed.traceback
    [rejected] = bus.dead_letters.list(reason=DeadLetterReason.REJECTED)
    assert (rejected.error, rejected.traceback) == ("Reject: refunds are closed", None)


async def _fill_a_stage_behind_a_failure(bus: Bus, gate: anyio.Event, entered: anyio.Event) -> str:
    """Dead-letter one envelope of stage ``jobs@g`` (capacity 1), then fill that stage.

    Returns the dead envelope's id; the stage's one consumer then waits on ``gate``
    holding one envelope, and one more waits in its queue.
    """
    receipt = await bus.publish("jobs", "bad")
    await bus.drain()
    assert bus.dead_letters.get(receipt.id) is not None
    await bus.publish("jobs", "hold")
    await entered.wait()
    await bus.publish("jobs", "queued")
    return receipt.id


def _gated_stage(bus: Bus, gate: anyio.Event, entered: anyio.Event, seen: list[str]) -> None:
    failed: list[str] = []

    @bus.subscribe("jobs", group="g", capacity=1)
    async def handle(payload: str) -> None:
        seen.append(payload)
        if payload == "bad" and not failed:
            failed.append(payload)
            raise ValueError("first try fails")
        if payload == "hold":
            entered.set()
            await gate.wait()


async def test_two_concurrent_replays_of_one_id_send_it_once(
    assert_settled: Callable[[Bus], None],
) -> None:
    gate, entered = anyio.Event(), anyio.Event()
    seen: list[str] = []
    outcomes: list[object] = []
    bus = Bus()
    _gated_stage(bus, gate, entered, seen)

    async def replay(id: str) -> None:
        try:
            outcomes.append(await bus.dead_letters.replay(id))
        except KeyError as error:
            outcomes.append(error)

    with anyio.fail_after(10):
        async with bus:
            dead = await _fill_a_stage_behind_a_failure(bus, gate, entered)
            async with anyio.create_task_group() as tg:
                tg.start_soon(replay, dead)
                tg.start_soon(replay, dead)
                await anyio.wait_all_tasks_blocked()
                # one is waiting for room; the other found the entry taken
                assert len(outcomes) == 1 and isinstance(outcomes[0], KeyError)
                assert bus.dead_letters.get(dead) is not None  # still there until sent
                gate.set()
            await bus.drain()

    receipts = [outcome for outcome in outcomes if isinstance(outcome, list)]
    assert len(receipts) == 1 and len(receipts[0]) == 1
    assert seen.count("bad") == 2  # the first try, and one replay
    assert bus.dead_letters.get(dead) is None
    assert stage_stats(bus, "jobs@g").published == 4
    assert_settled(bus)


async def test_a_replay_cut_off_by_the_shutdown_keeps_its_dead_letter(
    assert_settled: Callable[[Bus], None],
) -> None:
    gate, entered = anyio.Event(), anyio.Event()
    seen: list[str] = []
    errors: list[BusClosedError] = []
    bus = Bus()
    _gated_stage(bus, gate, entered, seen)

    async def replay(id: str) -> None:
        with pytest.raises(BusClosedError) as caught:
            await bus.dead_letters.replay(id)
        errors.append(caught.value)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg, bus:
            dead = await _fill_a_stage_behind_a_failure(bus, gate, entered)
            tg.start_soon(replay, dead)
            await anyio.wait_all_tasks_blocked()
            report = await bus.aclose(timeout=0.05)

    assert len(errors) == 1
    letter = bus.dead_letters.get(dead)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert seen.count("bad") == 1
    stats = stage_stats(bus, "jobs@g")
    assert (stats.published, stats.dead_lettered, stats.abandoned) == (3, 1, 2)
    assert len(report.abandoned) == 2
    assert_settled(bus)


async def test_get_of_an_id_that_is_not_a_string_finds_nothing() -> None:
    with anyio.fail_after(5):
        async with Bus() as bus:
            await bus.publish("nobody.home", 1)
            assert bus.dead_letters.get(["not", "an", "id"]) is None  # type: ignore[arg-type]
            assert bus.dead_letters.get({"id": 1}) is None  # type: ignore[arg-type]
            assert len(bus.dead_letters) == 1


async def test_a_cancelled_replay_keeps_its_dead_letter_for_the_next_one(
    assert_settled: Callable[[Bus], None],
) -> None:
    gate, entered = anyio.Event(), anyio.Event()
    seen: list[str] = []
    bus = Bus()
    _gated_stage(bus, gate, entered, seen)

    with anyio.fail_after(10):
        async with bus:
            dead = await _fill_a_stage_behind_a_failure(bus, gate, entered)
            with anyio.move_on_after(0.01) as scope:
                await bus.dead_letters.replay(dead)  # waits for room, then is cancelled
            assert scope.cancelled_caught
            assert bus.dead_letters.get(dead) is not None
            gate.set()
            (receipt,) = await bus.dead_letters.replay(dead)  # no longer claimed
            await bus.drain()

    assert receipt.accepted == ("jobs@g",)
    assert seen.count("bad") == 2
    assert bus.dead_letters.get(dead) is None
    assert_settled(bus)


# -- the view of a store every process shares ---------------------------------------


def _entry(id: str, stage: str = "jobs@g") -> DeadLetter:
    return DeadLetter(
        Envelope(id=id, topic="jobs", payload=id),
        DeadLetterReason.HANDLER_FAILED,
        None,
        stage,
        1,
        time.time(),
    )


class _Store:
    """A store shared by every process, in this one: a load that waits until released."""

    def __init__(self, *entries: DeadLetter) -> None:
        self.entries = list(entries)
        self.release: anyio.Event | None = None

    async def load(self) -> list[DeadLetter]:
        if self.release is not None:
            await self.release.wait()
        return list(self.entries)

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        await anyio.lowlevel.checkpoint()
        taken = [entry for entry in self.entries if entry.envelope.id in ids]
        self.entries = [entry for entry in self.entries if entry not in taken]
        return taken

    async def put_back(self, entries: Sequence[DeadLetter]) -> None:
        self.entries.extend(entries)


def _view(store: _Store, sent: list[str] | None = None) -> DeadLetterQueue:
    async def resend(entry: DeadLetter) -> Receipt:
        if sent is None:
            raise BusClosedError("not running")
        sent.append(entry.envelope.id)
        return Receipt(entry.envelope.id, (entry.stage or "",))

    queue = DeadLetterQueue(ttl=60.0, maxlen=100, resend=resend)
    queue.share(store.load, store)
    return queue


async def test_a_refresh_keeps_what_changed_while_it_read() -> None:
    old, theirs, mine = _entry("old"), _entry("theirs"), _entry("mine")
    store = _Store(old)
    queue = _view(store)
    await queue.refresh()
    assert [entry.envelope.id for entry in queue.list()] == ["old"]
    store.release = anyio.Event()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(queue.refresh)
            await anyio.wait_all_tasks_blocked()
            # While the store is read: another process's entry arrives, one of this
            # process's is recorded, and the old one is taken elsewhere.
            queue.changed(added=[theirs])
            queue.add(mine)
            queue.changed(removed=[dead_letter_key(old)])
            store.release.set()  # the read answers as it was when it began
    assert [entry.envelope.id for entry in queue.list()] == ["theirs", "mine"]
    # The broker's copy of this process's own entry is the same entry.
    queue.changed(added=[dataclasses.replace(mine, dead_at=mine.dead_at + 0.5)])
    assert len(queue) == 2 and queue.get("mine") is mine


async def test_a_replay_over_a_shared_store_takes_before_it_sends_and_only_once() -> None:
    sent: list[str] = []
    store = _Store(_entry("a"), _entry("b"), _entry("b", "jobs@other"))
    queue = _view(store, sent)
    await queue.refresh()
    stale = _view(store, sent)  # another process, whose list is about to go stale
    await stale.refresh()
    receipts = await queue.replay("b")
    assert [receipt.accepted for receipt in receipts] == [("jobs@g",), ("jobs@other",)]
    assert [entry.envelope.id for entry in queue.list()] == ["a"]
    assert stale.get("b") is not None  # its list still shows it...
    with pytest.raises(KeyError, match="not in the dead-letter queue: b"):
        await stale.replay("b", "a")  # ...but the store decides, and nothing is sent
    assert sent == ["b", "b"] and [e.envelope.id for e in store.entries] == ["a"]


async def test_a_replay_that_cannot_send_puts_the_entries_back() -> None:
    store = _Store(_entry("a"))
    queue = _view(store)  # its bus is not running: every re-send fails
    await queue.refresh()
    with pytest.raises(BusClosedError):
        await queue.replay("a")
    assert [e.envelope.id for e in store.entries] == ["a"]
    assert [e.envelope.id for e in queue.list()] == ["a"]
