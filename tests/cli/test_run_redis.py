"""``python -m asyncbus run`` over Redis, under load: signals, drains, exit codes, restarts.

The workers run ``_targets.py`` (jobs handled one at a time, each counted in a Redis
hash under the test's prefix); the test publishes the jobs and counts: every job
whose publish was confirmed is handled exactly once, across the runs.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator

import anyio
import pytest
from _command import HERE, run_command

from asyncbus import Bus, Receipt
from asyncbus.transports import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

STAGE = "jobs@workers"


@pytest.fixture
async def publisher(redis_url: str, redis_prefix: str) -> AsyncIterator[Bus]:
    """A bus that publishes under the test's prefix (it subscribes to nothing)."""
    async with Bus(transport=RedisTransport(redis_url, prefix=redis_prefix)) as bus:
        yield bus


async def handled_counts(redis_url: str, prefix: str) -> dict[int, int]:
    """Job number -> times handled, from the workers' Redis hash."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        counts = await client.hgetall(f"{prefix}:handled")
    finally:
        await client.aclose()
    return {int(n): int(times) for n, times in counts.items()}


async def open_gate(redis_url: str, prefix: str) -> None:
    """Let the job waiting at the gate (``"gate": true``) go on."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.rpush(f"{prefix}:gate", 1)
    finally:
        await client.aclose()


def worker(prefix: str, *options: str, **env: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The arguments and environment of the command running ``_targets:bus``."""
    arguments = ("_targets:bus", "--app-dir", str(HERE), *options)
    return arguments, {"CLI_TEST_PREFIX": prefix, **env}


async def publish(bus: Bus, jobs: list[dict[str, object]]) -> list[Receipt]:
    receipts = [await bus.publish("jobs", job) for job in jobs]
    assert [r.accepted for r in receipts] == [(STAGE,)] * len(jobs)  # confirmed, for the group
    return receipts


async def test_sigterm_under_load_drains_every_confirmed_job_and_exits_0(
    publisher: Bus, redis_url: str, redis_prefix: str
) -> None:
    arguments, env = worker(redis_prefix, "--graceful-timeout", "60")
    async with run_command(*arguments, env=env) as command:
        await command.wait_for_event("running")
        # Job 50 holds the stage until the test opens its gate, so the drain cannot end
        # before the jobs published while it drains are in the broker.
        await publish(publisher, [{"n": n, "gate": n == 50} for n in range(100)])
        await command.wait_for(lambda r: r.get("cli_test") == "handled", count=10)
        command.send(signal.SIGTERM)  # mid-load: most jobs are still in the broker
        await command.wait_for(lambda r: "draining" in r.get("message", ""))
        # Published while it drains: the broker holds them for the group, so they count.
        await publish(publisher, [{"n": n} for n in range(100, 150)])
        await open_gate(redis_url, redis_prefix)
        assert await command.exit_code(timeout=60) == 0, command.text()
    report = command.report()
    assert report["drained"] is True and report["abandoned"] == []
    assert report["published"] == report["completed"] == 150
    assert sorted(command.handled()) == list(range(150))
    assert await handled_counts(redis_url, redis_prefix) == dict.fromkeys(range(150), 1)


async def test_work_abandoned_at_the_deadline_exits_3_and_is_redelivered_to_the_next_run(
    publisher: Bus, redis_url: str, redis_prefix: str
) -> None:
    jobs = [{"n": n, "slow": n in (3, 7)} for n in range(10)]
    arguments, env = worker(redis_prefix, "--graceful-timeout", "1")
    slow = {"CLI_TEST_BLOCK": "1", "CLI_TEST_CONCURRENCY": "4"}
    async with run_command(*arguments, env={**env, **slow}) as first:
        await first.wait_for_event("running")
        receipts = await publish(publisher, jobs)
        await first.wait_for(lambda r: r.get("cli_test") == "blocking", count=2)
        await first.wait_for(lambda r: r.get("cli_test") == "handled", count=8)
        assert await first.stop(signal.SIGTERM) == 3, first.text()
    report = first.report()
    # Two of the four consumers blocked, each in a slow job, past the deadline.
    assert report["drained"] is False
    assert sorted(report["abandoned"]) == sorted([receipts[3].id, receipts[7].id])
    assert (report["completed"], report["dead_lettered"]) == (8, 0)
    assert await handled_counts(redis_url, redis_prefix) == {
        n: 1 for n in range(10) if n not in (3, 7)
    }

    # The next run (nothing blocks now) gets the abandoned jobs back from the broker.
    async with run_command(*arguments, env=env) as second:
        await second.wait_for(lambda r: r.get("cli_test") == "handled", count=2)
        assert await second.stop(signal.SIGTERM) == 0, second.text()
    assert sorted(second.handled()) == [3, 7]
    assert second.report()["drained"] is True
    assert await handled_counts(redis_url, redis_prefix) == dict.fromkeys(range(10), 1)


async def test_a_second_sigint_stops_at_once_exits_3_and_reports(
    publisher: Bus, redis_prefix: str
) -> None:
    arguments, env = worker(redis_prefix, "--graceful-timeout", "60")
    async with run_command(*arguments, env={**env, "CLI_TEST_BLOCK": "1"}) as command:
        await command.wait_for_event("running")
        (receipt,) = await publish(publisher, [{"n": 0, "slow": True}])
        await command.wait_for(lambda r: r.get("cli_test") == "blocking")
        command.send(signal.SIGINT)
        await command.wait_for(lambda r: "draining" in r.get("message", ""))
        started = anyio.current_time()
        command.send(signal.SIGINT)
        assert await command.exit_code(timeout=20) == 3, command.text()
        assert anyio.current_time() - started < 10  # not the 60 s deadline
    report = command.report()
    assert report["drained"] is False and report["abandoned"] == [receipt.id]
    assert command.matching(lambda r: "again: stopping at once" in r.get("message", ""))


async def test_a_crashed_worker_is_restarted_and_every_job_is_handled_once(
    publisher: Bus, redis_url: str, redis_prefix: str
) -> None:
    arguments, env = worker(redis_prefix, "--workers", "2", "--graceful-timeout", "30")
    async with run_command(*arguments, env={**env, "CLI_TEST_CRASH": "1"}) as command:
        await command.wait_for_event("running", count=2)
        # The crash job first: the worker that takes it has handled nothing yet (and
        # holds nothing else), so nothing it handled can come back.
        await publish(publisher, [{"n": 0, "crash": True}, *({"n": n} for n in range(1, 30))])
        crashed = await command.wait_for(lambda r: "exited with status 17" in r.get("message", ""))
        assert "restarting it in" in crashed[0]["message"]
        await command.wait_for_event("running", count=3)  # the replacement
        await command.wait_for(lambda r: r.get("cli_test") == "handled", count=30, timeout=60)
        assert await command.stop(signal.SIGTERM) == 0, command.text()
    assert sorted(command.handled()) == list(range(30))
    assert await handled_counts(redis_url, redis_prefix) == dict.fromkeys(range(30), 1)
    reports = [r["asyncbus_report"] for r in command.records if "asyncbus_report" in r]
    assert len(reports) == 2 and all(report["drained"] for report in reports)
