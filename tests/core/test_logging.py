"""What the bus logs: every envelope that is not acked leaves one record, rate-limited.

Records are asserted exactly (logger, level, message, ``extra=`` fields, traceback),
and an acked envelope leaves none, even at DEBUG.
"""

from __future__ import annotations

import logging
import sys
import time
import types
from typing import Any

import anyio
import pytest

from asyncbus import Backpressure, Bus, Envelope, Reject, Retry

pytestmark = pytest.mark.anyio

FIELDS = (
    "asyncbus_stage",
    "asyncbus_envelope_id",
    "asyncbus_topic",
    "asyncbus_attempt",
    "asyncbus_reason",
    "asyncbus_correlation_id",
)


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Captures every record of the ``asyncbus`` hierarchy from DEBUG up."""
    caplog.set_level(logging.DEBUG, logger="asyncbus")
    return caplog


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The records of the ``asyncbus`` hierarchy captured so far in this test."""
    return [record for record in caplog.records if record.name.startswith("asyncbus")]


def fields(record: logging.LogRecord) -> tuple[Any, ...]:
    return tuple(getattr(record, name) for name in FIELDS)


def said(record: logging.LogRecord) -> tuple[str, int, str]:
    return (record.name, record.levelno, record.getMessage())


class FakeClock:
    """A monotonic clock the test moves by hand (the rate limiter's interval)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_retried_failure_is_debug_and_the_final_one_a_warning_with_its_traceback(
    records: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    bus = Bus()

    retry = Retry(max_attempts=2, backoff=0.001, jitter=False)

    @bus.subscribe("orders.created", group="mailer", retry=retry)
    async def mail(env: Envelope) -> None:
        raise RuntimeError(f"unlucky order {env.payload['id']}")

    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("orders.created", {"id": 13})
            await bus.drain()

    retried, final = ours(records)
    stage = "orders.created@mailer"
    assert said(retried) == (
        "asyncbus.stage",
        logging.DEBUG,
        f"attempt 1 of envelope {receipt.id} on topic 'orders.created' failed in stage "
        f"'{stage}', retrying in 0.001s: RuntimeError: unlucky order 13",
    )
    assert fields(retried) == (stage, receipt.id, "orders.created", 1, "retrying", receipt.id)
    assert retried.exc_info is not None and isinstance(retried.exc_info[1], RuntimeError)

    assert said(final) == (
        "asyncbus.dead_letters",
        logging.WARNING,
        f"dead-lettered handler_failed: envelope {receipt.id} on topic 'orders.created' in "
        f"stage '{stage}' after 2 attempt(s): RuntimeError: unlucky order 13",
    )
    assert fields(final) == (stage, receipt.id, "orders.created", 2, "handler_failed", receipt.id)
    assert final.asyncbus_suppressed == 0  # type: ignore[attr-defined]
    assert final.exc_info is not None
    assert str(final.exc_info[1]) == "unlucky order 13"
    # The traceback reaches into the handler that raised.
    assert 'raise RuntimeError(f"unlucky order' in logging.Formatter().format(final)
    # The library itself never prints.
    assert capsys.readouterr() == ("", "")


async def test_an_acked_envelope_logs_nothing_even_at_debug(
    records: pytest.LogCaptureFixture,
) -> None:
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("work", group="g", retry=Retry(max_attempts=3))
    async def work(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            for n in range(200):
                await bus.publish("work", n)
            await bus.drain()

    assert handled == list(range(200))
    assert ours(records) == []


async def test_a_topic_nobody_subscribes_to_is_logged_once_per_interval_with_a_count(
    records: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    clock = FakeClock()
    bus._services.failure_log.clock = clock
    bus.subscribe("orders.created", lambda order: None, group="audit", offload="inline")

    with anyio.fail_after(10):
        async with bus:
            first = await bus.publish("ordrs.created", {"id": 1})  # a typo
            for n in range(2, 51):
                await bus.publish("ordrs.created", {"id": n})
            other = await bus.publish("other.typo", None)
            assert [said(r)[2] for r in ours(records)] == [
                f"dead-lettered no_subscribers: envelope {first.id} on topic 'ordrs.created',"
                " which no stage subscribes to",
                f"dead-lettered no_subscribers: envelope {other.id} on topic 'other.typo',"
                " which no stage subscribes to",
            ]
            expected = (None, first.id, "ordrs.created", 0, "no_subscribers", first.id)
            assert fields(ours(records)[0]) == expected
            assert ours(records)[0].exc_info is None

            clock.now += bus._services.failure_log.interval  # the next interval
            later = await bus.publish("ordrs.created", {"id": 51})
            # Within this interval again: counted, not written; told when the bus closes.
            await bus.publish("ordrs.created", {"id": 52})
            await bus.publish("ordrs.created", {"id": 53})

    assert len(bus.dead_letters) == 54  # every one is dead-lettered, whatever is logged
    written = ours(records)[2:]
    assert [said(r) for r in written] == [
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            f"dead-lettered no_subscribers: envelope {later.id} on topic 'ordrs.created', which"
            " no stage subscribes to (49 similar records suppressed since the last one)",
        ),
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            "2 more no_subscribers record(s) for topic 'ordrs.created' were suppressed",
        ),
    ]
    assert written[0].asyncbus_suppressed == 49  # type: ignore[attr-defined]
    assert fields(written[1]) == (None, None, "ordrs.created", None, "no_subscribers", None)
    assert written[1].asyncbus_suppressed == 2  # type: ignore[attr-defined]


async def test_expired_rejected_timed_out_and_dropped_envelopes_are_warnings(
    records: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = Bus()
    release = anyio.Event()
    started = anyio.Event()

    @bus.subscribe("refuse", group="g")
    async def refuse(payload: Any) -> None:
        raise Reject("not for us")

    @bus.subscribe("slow", group="g", timeout=0.01)
    async def slow(payload: Any) -> None:
        await anyio.sleep_forever()

    @bus.subscribe("stale", group="g")
    async def stale(payload: Any) -> None:
        raise AssertionError("an expired envelope is never handled")

    @bus.subscribe("full", group="g", capacity=1, backpressure=Backpressure.DROP_NEWEST)
    async def full(payload: Any) -> None:
        started.set()
        await release.wait()

    with anyio.fail_after(10):
        async with bus:
            rejected = await bus.publish("refuse", 1)
            timed_out = await bus.publish("slow", 2)
            await bus.drain()
            # Expiry compares the wall clock with timestamp + ttl: an hour has passed.
            later = types.SimpleNamespace(time=lambda: time.time() + 3600)
            monkeypatch.setattr(sys.modules["asyncbus.middleware.expire"], "time", later)
            expired = await bus.publish("stale", 3, ttl=60)
            await bus.drain()
            await bus.publish("full", 4)
            await started.wait()
            await bus.publish("full", 5)  # queued
            dropped = await bus.publish("full", 6)  # no room: dropped at the door
            release.set()
            await bus.drain()

    assert [said(r) for r in ours(records)] == [
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            f"dead-lettered rejected: envelope {rejected.id} on topic 'refuse' in stage "
            "'refuse@g' after 1 attempt(s): Reject: not for us",
        ),
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            f"dead-lettered timeout: envelope {timed_out.id} on topic 'slow' in stage "
            "'slow@g' after 1 attempt(s): HandlerTimeout: handler took longer than 0.01s",
        ),
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            f"dead-lettered expired: envelope {expired.id} on topic 'stale' in stage 'stale@g'",
        ),
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            f"dead-lettered dropped: envelope {dropped.id} on topic 'full' in stage 'full@g'",
        ),
    ]
    reasons = [(r.__dict__["asyncbus_reason"], r.__dict__["asyncbus_stage"]) for r in ours(records)]
    assert reasons == [
        ("rejected", "refuse@g"),
        ("timeout", "slow@g"),
        ("expired", "stale@g"),
        ("dropped", "full@g"),
    ]
    # A traceback only for a handler's own failure, none of these.
    assert [r.exc_info for r in ours(records)] == [None, None, None, None]


async def test_a_full_reject_stage_logs_what_it_turned_away(
    records: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    release = anyio.Event()
    started = anyio.Event()

    @bus.subscribe("jobs", group="g", capacity=1, backpressure=Backpressure.REJECT)
    async def job(payload: Any) -> None:
        started.set()
        await release.wait()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            await started.wait()
            await bus.publish("jobs", 2)
            turned_away = await bus.publish("jobs", 3, headers={"tenant": "a"})
            assert turned_away.rejected == ("jobs@g",)
            release.set()
            await bus.drain()

    (record,) = ours(records)
    assert said(record) == (
        "asyncbus.stage",
        logging.WARNING,
        f"stage 'jobs@g' is full (capacity 1): envelope {turned_away.id} on topic 'jobs' "
        "rejected at the door",
    )
    expected = ("jobs@g", turned_away.id, "jobs", 1, "rejected_at_door", turned_away.id)
    assert fields(record) == expected


async def test_what_shutdown_abandons_is_one_warning_per_stage(
    records: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    started = anyio.Event()

    @bus.subscribe("stuck", group="g", concurrency=1)
    async def stuck(payload: Any) -> None:
        started.set()
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        async with bus:
            first = await bus.publish("stuck", 1)
            second = await bus.publish("stuck", 2)
            await started.wait()
            report = await bus.aclose(timeout=0.05)

    assert sorted(report.abandoned) == sorted([first.id, second.id])
    (record,) = ours(records)
    assert said(record) == (
        "asyncbus.stage",
        logging.WARNING,
        f"stage 'stuck@g' abandoned 2 envelope(s) at shutdown: {', '.join(report.abandoned)}",
    )
    assert fields(record) == ("stuck@g", None, None, None, "abandoned", None)
    assert record.asyncbus_envelope_ids == tuple(report.abandoned)  # type: ignore[attr-defined]


async def test_a_flood_of_handler_failures_in_one_stage_is_rate_limited(
    records: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    bus._services.failure_log.clock = FakeClock()

    @bus.subscribe("flaky", group="g", concurrency=4)
    async def flaky(n: int) -> None:
        raise ValueError(n)

    with anyio.fail_after(10):
        async with bus:
            for n in range(100):
                await bus.publish("flaky", n)
            await bus.drain()
            assert bus.statistics().dead_lettered == 100
            assert len(ours(records)) == 1

    first, told = ours(records)
    assert first.getMessage().startswith("dead-lettered handler_failed: envelope ")
    assert said(told) == (
        "asyncbus.dead_letters",
        logging.WARNING,
        "99 more handler_failed record(s) for stage 'flaky@g' were suppressed",
    )


async def test_nothing_is_written_below_the_configured_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncbus")
    bus = Bus()

    @bus.subscribe("boom", group="g", retry=Retry(max_attempts=2, backoff=0.001))
    async def boom(payload: Any) -> None:
        raise RuntimeError("boom")

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("boom", 1)
            await bus.publish("nobody", 1)
            await bus.drain()

    assert ours(caplog) == []
    assert bus.statistics().dead_lettered == 1 and len(bus.dead_letters) == 2


async def test_a_failing_deadletter_handler_is_told_through_the_failure_log(
    records: pytest.LogCaptureFixture,
) -> None:
    bus = Bus()
    bus._services.failure_log.clock = FakeClock()

    @bus.subscribe("jobs", group="jobs")
    async def handle(n: int) -> None:
        raise ValueError(n)

    @bus.subscribe("$deadletter", group="alerts")
    async def alert(_: object) -> None:
        raise RuntimeError("pager down")

    with anyio.fail_after(10):
        async with bus:
            first = await bus.publish("jobs", 0)
            await bus.drain()
            for n in range(1, 10):
                await bus.publish("jobs", n)
            await bus.drain()
            announcements = [
                record for record in ours(records) if record.getMessage().startswith("discarded")
            ]
            assert len(announcements) == 1  # the other nine are rate-limited

    (record,) = announcements
    assert record.name == "asyncbus.dead_letters" and record.levelno == logging.WARNING
    stage, envelope_id, topic, attempt, reason, correlation_id = fields(record)
    assert (stage, topic, attempt, reason, correlation_id) == (
        "$deadletter@alerts",
        "$deadletter",
        1,
        "handler_failed",
        first.id,
    )
    assert record.getMessage() == (
        f"discarded handler_failed: $deadletter envelope {envelope_id} (about {first.id}) in "
        "stage '$deadletter@alerts' after 1 attempt(s): RuntimeError: pager down"
    )
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert record.asyncbus_suppressed == 0  # type: ignore[attr-defined]
    told = [
        said(record)
        for record in ours(records)
        if "record(s) for stage '$deadletter@alerts'" in record.getMessage()
    ]
    assert told == [
        (
            "asyncbus.dead_letters",
            logging.WARNING,
            "9 more handler_failed record(s) for stage '$deadletter@alerts' were suppressed",
        )
    ]
