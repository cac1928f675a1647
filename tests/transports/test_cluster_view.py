"""One view of the deployment over Redis, NATS and PostgreSQL: three worker processes and
a console.

Each process writes heartbeats through the broker; the console's
``bus.cluster_statistics()`` lists every process by host and pid with its own figures,
and its totals are their sums, exactly. A process killed with SIGKILL is marked stale
after three missed heartbeats; one stopped cleanly deletes its record and leaves the view.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest
from _brokers import make_transport, names  # type: ignore[import-not-found]
from _processes import stop  # type: ignore[import-not-found]

from asyncbus import Bus, ClusterStatistics, ProcessStatistics

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

WORKER = Path(__file__).with_name("_cluster_worker.py")
COUNTS = {"a": 5, "b": 7, "c": 11}


@pytest.fixture(params=names("heartbeats"))
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _until(bus: Bus, done: object) -> ClusterStatistics:
    """The console's view, once ``done(view)`` holds (polled; bounded by the test's
    deadline)."""
    while True:
        view = bus.cluster_statistics()
        if done(view):  # type: ignore[operator]
            return view
        await anyio.sleep(0.05)


def _workers(view: ClusterStatistics) -> dict[str, ProcessStatistics]:
    return {process.bus: process for process in view.processes if not process.this_process}


async def test_three_processes_are_seen_summed_and_a_killed_one_is_marked_stale(
    kind: str, url: str, unique_prefix: str, tmp_path: Path
) -> None:
    processes = {
        name: subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                kind,
                url,
                unique_prefix,
                name,
                str(count),
                str(tmp_path / f"{name}.ready"),
            ],
            cwd=Path(__file__).parent,
        )
        for name, count in COUNTS.items()
    }
    try:
        with anyio.fail_after(90):
            while not all((tmp_path / f"{name}.ready").exists() for name in COUNTS):
                for process in processes.values():
                    assert process.poll() is None, "a worker exited early"
                await anyio.sleep(0.05)
            console = Bus(
                transport=make_transport(kind, url, unique_prefix), name="console", heartbeat=0.2
            )
            async with console:

                def all_counted(view: ClusterStatistics) -> bool:
                    workers = _workers(view)
                    return set(workers) == set(COUNTS) and all(
                        workers[name].statistics.acked == count for name, count in COUNTS.items()
                    )

                view = await _until(console, all_counted)
                workers = _workers(view)
                assert [p.this_process for p in view.processes] == [True, False, False, False]
                assert view.processes[0].pid == os.getpid()
                for name, process in processes.items():
                    seen = workers[name]
                    assert (seen.host, seen.pid, seen.stale) == (
                        socket.gethostname(),
                        process.pid,
                        False,
                    )
                    assert seen.name == f"{socket.gethostname()}:{process.pid}"
                    (stage,) = seen.statistics.stages
                    assert (stage.name, stage.published, stage.acked) == (
                        f"jobs.{name}@{name}",
                        COUNTS[name],
                        COUNTS[name],
                    )
                totals = view.totals
                assert (totals.published, totals.acked, totals.dead_lettered) == (23, 23, 0)
                assert totals.published == sum(p.statistics.published for p in view.processes)
                assert [(s.name, s.acked) for s in totals.stages] == [
                    (f"jobs.{name}@{name}", count) for name, count in COUNTS.items()
                ]

                processes["b"].send_signal(signal.SIGKILL)
                processes["b"].wait()
                view = await _until(console, lambda v: _workers(v)["b"].stale)
                assert {name: p.stale for name, p in _workers(view).items()} == {
                    "a": False,
                    "b": True,
                    "c": False,
                }
                assert view.totals.acked == 23  # what it did still happened
                assert sorted(p.bus for p in view.live) == ["a", "c", "console"]

                stop(processes["a"])
                view = await _until(console, lambda v: "a" not in _workers(v))
                assert sorted(_workers(view)) == ["b", "c"]
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


async def test_over_rabbitmq_the_view_is_this_process_alone(
    unique_prefix: str, require_service: Callable[[str, int], None]
) -> None:
    require_service("RabbitMQ", 5672)
    from asyncbus.transports.rabbit import RabbitTransport

    url = "amqp://guest:guest@127.0.0.1:5672/"
    other = Bus(transport=RabbitTransport(url, prefix=unique_prefix), heartbeat=0.2)
    bus = Bus(transport=RabbitTransport(url, prefix=unique_prefix), heartbeat=0.2)
    with anyio.fail_after(30):
        async with other, bus:
            # RabbitMQ has no place for heartbeats (the transport offers none).
            assert not hasattr(bus.transport, "beat")
            view = bus.cluster_statistics()
            assert [p.this_process for p in view.processes] == [True]
            assert view.totals.published == bus.statistics().published


async def test_heartbeat_records_another_client_garbled_are_skipped_over_redis(
    redis_url: str, unique_prefix: str
) -> None:
    import time

    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    now = int(time.time() * 1000)
    try:
        garbage = {"junk": b"\xff not json", "old": b'{"v": 99}', "half": b'{"v": 1, "host": "x"}'}
        await client.hset(f"{unique_prefix}:heartbeats", mapping=garbage)
        await client.zadd(f"{unique_prefix}:heartbeats:seen", dict.fromkeys(garbage, now))
        bus = Bus(transport=make_transport("redis", redis_url, unique_prefix), heartbeat=0.2)
        with anyio.fail_after(30):
            async with bus:
                # A round that read the garbled records has passed once the bus's own is there.
                while not await client.hexists(
                    f"{unique_prefix}:heartbeats", bus._cluster.instance
                ):
                    await anyio.sleep(0.02)
                await bus._cluster.beat_once()
                view = bus.cluster_statistics()
                assert [p.this_process for p in view.processes] == [True]
    finally:
        await client.aclose()
