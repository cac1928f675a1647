"""Delayed and scheduled publishes in memory, on asyncio, uvloop and trio.

A publish given ``delay=`` or ``at=`` is held by the bus, listed by ``bus.scheduled()``,
counted in the statistics, cancellable until it is due, and published when due as a
publish at that moment would be; what is still held at the close is abandoned and
listed in the report. (Hours of time run on a mock clock in ``test_time_clock.py``.)
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

import anyio
import anyio.from_thread
import pytest

from asyncbus import (
    Bus,
    BusClosedError,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    HandlerError,
    ScheduledEnvelope,
)
from asyncbus._subscription import default_group

pytestmark = pytest.mark.anyio

UTC = dt.UTC


class Seen:
    """What a handler received, and an event per expected count."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []
        self.times: list[float] = []
        self._waiters: list[tuple[int, anyio.Event]] = []

    async def __call__(self, envelope: Envelope) -> None:
        self.envelopes.append(envelope)
        self.times.append(anyio.current_time())
        for count, event in self._waiters:
            if len(self.envelopes) >= count:
                event.set()

    async def wait_for(self, count: int) -> None:
        event = anyio.Event()
        self._waiters.append((count, event))
        if len(self.envelopes) >= count:
            event.set()
        await event.wait()

    @property
    def payloads(self) -> list[Any]:
        return [envelope.payload for envelope in self.envelopes]


async def test_a_delayed_publish_is_held_listed_then_published_when_due(
    assert_settled: Callable[[Bus], None],
) -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            began = anyio.current_time()
            receipt = await bus.publish("jobs", {"n": 1}, delay=0.2, headers={"h": "v"})
            assert receipt.accepted == () and receipt
            assert receipt.scheduled is not None and receipt.scheduled.tzinfo is not None
            [held] = bus.scheduled()
            assert isinstance(held, ScheduledEnvelope)
            assert (held.id, held.topic, held.due) == (receipt.id, "jobs", receipt.scheduled)
            assert bus.statistics().scheduled == 1
            assert bus.statistics().published == 0  # no stage has it yet
            await seen.wait_for(1)
            assert seen.times[0] - began >= 0.199
            assert bus.scheduled() == [] and bus.statistics().scheduled == 0
            await bus.drain()
            report = await bus.aclose()
    [envelope] = seen.envelopes
    assert (envelope.id, envelope.payload, dict(envelope.headers)) == (
        receipt.id,
        {"n": 1},
        {"h": "v"},
    )
    assert envelope.attempt == 1
    assert (report.published, report.completed, report.abandoned, report.scheduled) == (
        1,
        1,
        [],
        [],
    )
    assert_settled(bus)


async def test_scheduled_envelopes_come_out_in_due_order_whatever_the_publish_order() -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    now = dt.datetime.now(UTC)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", "third", delay=0.3)
            await bus.publish("jobs", "first", at=now + dt.timedelta(seconds=0.1))
            await bus.publish_many("jobs", ["second-a", "second-b"], delay=0.2)
            assert [s.envelope.payload for s in bus.scheduled()] == [
                "first",
                "second-a",
                "second-b",
                "third",
            ]
            await seen.wait_for(4)
    assert seen.payloads == ["first", "second-a", "second-b", "third"]


async def test_at_in_another_time_zone_is_the_same_instant() -> None:
    bus = Bus()
    bus.subscribe("jobs", Seen(), group="g")
    zone = dt.timezone(dt.timedelta(hours=-5), "EST")
    at = dt.datetime.now(zone) + dt.timedelta(hours=2)
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1, at=at)
            assert receipt.scheduled == at  # the same instant (shown in UTC)
            assert receipt.scheduled is not None and receipt.scheduled.utcoffset() == dt.timedelta(
                0
            )
            report = await bus.aclose()
    assert report.scheduled == [receipt.id]


async def test_cancel_scheduled_says_whether_it_was_still_pending() -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            kept = await bus.publish("jobs", "kept", delay=0.1)
            cancelled = await bus.publish("jobs", "cancelled", delay=0.05)
            assert await bus.cancel_scheduled(cancelled.id) is True
            assert await bus.cancel_scheduled(cancelled.id) is False  # twice: gone already
            assert await bus.cancel_scheduled("no-such-id") is False
            assert [s.id for s in bus.scheduled()] == [kept.id]
            await seen.wait_for(1)
            assert await bus.cancel_scheduled(kept.id) is False  # published already
            # the same id may be scheduled again once it is no longer held
            again = await bus.publish("jobs", "again", delay=0.01, id=cancelled.id)
            await seen.wait_for(2)
    assert seen.payloads == ["kept", "again"]
    assert again.id == cancelled.id


async def test_an_id_already_held_is_refused_and_nothing_changes() -> None:
    bus = Bus()
    bus.subscribe("jobs", Seen(), group="g")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1, delay=60, id="same")
            with pytest.raises(ConfigurationError, match="already scheduled"):
                await bus.publish("jobs", 2, delay=30, id="same")
            assert [s.envelope.payload for s in bus.scheduled()] == [1]
            await bus.aclose()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"delay": -1}, "delay must be a finite number"),
        ({"delay": math.nan}, "delay must be a finite number"),
        ({"delay": math.inf}, "delay must be a finite number"),
        ({"delay": "5"}, "delay must be a finite number"),
        ({"delay": True}, "delay must be a finite number"),
        ({"at": dt.datetime(2030, 1, 1)}, "naive datetime"),
        ({"at": "2030-01-01T00:00:00Z"}, "timezone-aware datetime"),
        ({"at": dt.datetime(2030, 1, 1, tzinfo=UTC), "delay": 1}, "not both"),
    ],
)
async def test_bad_delay_or_at_is_a_configuration_error_and_nothing_is_held(
    options: dict[str, Any], message: str
) -> None:
    bus = Bus()
    bus.subscribe("jobs", Seen(), group="g")
    with anyio.fail_after(10):
        async with bus:
            with pytest.raises(ConfigurationError, match=message):
                await bus.publish("jobs", 1, **options)
            with pytest.raises(ConfigurationError, match=message):
                await bus.publish_many("jobs", [1, 2], **options)
            with pytest.raises(ConfigurationError, match=message):
                await bus.request("jobs", 1, **options)
            assert bus.scheduled() == []


async def test_a_delay_of_zero_or_a_past_instant_publishes_at_once() -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            now = await bus.publish("jobs", "now", delay=0)
            past = await bus.publish("jobs", "past", at=dt.datetime(2001, 1, 1, tzinfo=UTC))
            assert now.scheduled is not None and past.scheduled is not None
            await seen.wait_for(2)
    assert sorted(seen.payloads) == ["now", "past"]


async def test_at_close_what_is_not_due_is_abandoned_and_listed_in_the_report(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            later = await bus.publish_many("jobs", [1, 2], delay=3600)
            await bus.publish("jobs", 3)
            await bus.drain()  # drain does not wait for scheduled envelopes
            report = await bus.aclose()
    assert report.scheduled == [receipt.id for receipt in later]
    assert (report.published, report.completed, report.abandoned) == (1, 1, [])
    assert bus.scheduled() == [] and bus.statistics().scheduled == 0
    assert "2 scheduled envelope(s) not due yet were abandoned" in caplog.text
    assert seen.payloads == [3]
    with pytest.raises(BusClosedError):
        await bus.publish("jobs", 4, delay=1)


async def test_a_scheduled_envelope_nobody_subscribes_to_when_due_is_dead_lettered() -> None:
    announced = Seen()
    bus = Bus()
    bus.subscribe("$deadletter", announced, group="watch")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("nobody.home", 1, delay=0.05)
            assert len(bus.dead_letters) == 0  # it was not routed at the publish
            await announced.wait_for(1)
            [entry] = bus.dead_letters.list()
    assert (entry.envelope.id, entry.reason) == (receipt.id, DeadLetterReason.NO_SUBSCRIBERS)


async def test_when_due_it_reaches_the_groups_that_exist_then() -> None:
    early, late = Seen(), Seen()
    bus = Bus()
    bus.subscribe("jobs", early, group="early")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1, delay=0.2)
            bus.subscribe("jobs", late, group="late")  # subscribed after the publish
            await early.wait_for(1)
            await late.wait_for(1)
    assert early.envelopes[0].id == late.envelopes[0].id == receipt.id


async def test_ttl_counts_from_when_it_is_published_not_from_the_call() -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1, delay=0.3, ttl=0.2)
            await seen.wait_for(1)
    assert len(bus.dead_letters) == 0


async def test_a_handler_schedules_a_follow_up_in_its_conversation() -> None:
    seen = Seen()
    bus = Bus()

    @bus.subscribe("start", group="s")
    async def start(envelope: Envelope) -> None:
        await bus.publish("follow", "up", delay=0.05)

    bus.subscribe("follow", seen, group="f")
    with anyio.fail_after(10):
        async with bus:
            first = await bus.publish("start", 1)
            await seen.wait_for(1)
    [follow] = seen.envelopes
    assert (follow.correlation_id, follow.causation_id) == (first.id, first.id)


async def test_a_delayed_request_waits_for_its_reply() -> None:
    bus = Bus()

    @bus.subscribe("double", group="d")
    async def double(n: int) -> int:
        return n * 2

    with anyio.fail_after(10):
        async with bus:
            began = anyio.current_time()
            assert await bus.request("double", 21, delay=0.1) == 42
            assert anyio.current_time() - began >= 0.099  # (uvloop: milliseconds)
            with pytest.raises(TimeoutError):
                await bus.request("double", 1, delay=5, timeout=0.1)


async def test_a_delayed_request_nobody_serves_fails_when_due() -> None:
    bus = Bus()
    with anyio.fail_after(10):
        async with bus:
            with pytest.raises(HandlerError):
                await bus.request("nobody.home", 1, delay=0.05, timeout=5)


async def test_a_delayed_publish_with_a_slip_forwards_as_usual() -> None:
    seen = Seen()
    bus = Bus()

    @bus.subscribe("step.one", group="one")
    async def one(n: int) -> int:
        return n + 1

    bus.subscribe("step.two", seen, group="two")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("step.one", 1, delay=0.05, slip=["step.two"])
            await seen.wait_for(1)
    assert seen.payloads == [2]


async def test_statistics_and_listing_from_another_thread() -> None:
    bus = Bus()
    bus.subscribe("jobs", Seen(), group="g")
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1, delay=3600)
            listed = await anyio.to_thread.run_sync(bus.scheduled)
            counted = await anyio.to_thread.run_sync(lambda: bus.statistics().scheduled)
            assert ([s.id for s in listed], counted) == ([receipt.id], 1)
            await bus.aclose()


async def test_a_delay_may_be_a_timedelta() -> None:
    seen = Seen()
    bus = Bus()
    bus.subscribe("jobs", seen, group="g")
    with anyio.fail_after(10):
        async with bus:
            before = dt.datetime.now(dt.UTC)
            receipt = await bus.publish("jobs", 1, delay=dt.timedelta(milliseconds=50))
            [second] = await bus.publish_many("jobs", [2], delay=dt.timedelta(hours=2))
            assert receipt.scheduled is not None and second.scheduled is not None
            # (the bus's clock is the wall clock read at its start, then the loop's)
            soon, later = receipt.scheduled - before, second.scheduled - before
            assert dt.timedelta(milliseconds=0) < soon < dt.timedelta(milliseconds=500)
            hours = dt.timedelta(hours=2)
            assert hours - dt.timedelta(milliseconds=50) < later < hours + dt.timedelta(seconds=1)
            await seen.wait_for(1)
            for bad in (dt.timedelta(seconds=-1), dt.timedelta(days=365 * 40)):
                with pytest.raises(ConfigurationError, match="delay"):
                    await bus.publish("jobs", 3, delay=bad)
            assert await bus.cancel_scheduled(second.id)
    assert seen.payloads == [1]


async def test_a_periodic_job_may_take_no_argument() -> None:
    bus = Bus()
    ran: list[str] = []
    both = anyio.Event()

    def note(name: str) -> None:
        ran.append(name)
        if {"async", "sync"} <= set(ran):
            both.set()

    @bus.periodic(every=0.05, name="async-job")
    async def async_job() -> None:
        note("async")

    @bus.periodic(every=0.05, name="sync-job")
    def sync_job() -> None:  # (run on the worker threads, as any sync handler)
        anyio.from_thread.run_sync(note, "sync")

    with anyio.fail_after(10):
        async with bus:
            await both.wait()
            groups = {stage.group for stage in bus.statistics().stages}
    # the default group is still the function's own (module and name): the wrapper
    # that leaves the payload out does not change it
    # (a local function's default group ends with a count, one per call)
    expected = {default_group(async_job), default_group(sync_job)}
    assert {g.partition("#")[0] for g in groups} == {g.partition("#")[0] for g in expected}
    assert all("#" in group for group in groups)
    assert sorted(set(ran)) == ["async", "sync"]
