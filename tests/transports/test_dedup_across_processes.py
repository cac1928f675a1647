"""deduplicate() over a broker: the claim lives in the broker, so another process sees it.

A worker process (``_dedup_worker.py``) handles an envelope and dies without acking
it; the broker redelivers it to this process, whose bus runs ``deduplicate()`` too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from _brokers import (  # type: ignore[import-not-found]
    make_transport,
    names,
)

from asyncbus import Bus, Envelope
from asyncbus.middleware import deduplicate

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

#: The brokers that keep deduplicate()'s store (RabbitMQ has none: see its docs).
on_shared_claims = pytest.mark.parametrize("kind", names("dedup_store"), indirect=True)

WORKER = Path(__file__).with_name("_dedup_worker.py")
ACK_TIMEOUT = 1.5  # the worker's
LEASE = 4.0


class Worker:
    """The worker process, its output and readiness files."""

    def __init__(self, kind: str, url: str, prefix: str, folder: Path, mode: str) -> None:
        self.out = folder / f"{mode}.txt"
        self.ready = folder / f"{mode}.ready"
        self.out.touch()
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), kind, url, prefix, str(self.out), str(self.ready),
             mode, str(LEASE)]
        )  # fmt: skip

    def events(self) -> list[str]:
        return self.out.read_text().splitlines()

    async def wait_for(self, line: str) -> None:
        with anyio.fail_after(30):
            while line not in self.events():
                await anyio.sleep(0.02)

    async def wait_ready(self) -> None:
        with anyio.fail_after(30):
            while not self.ready.exists():
                assert self.process.poll() is None, "the worker exited early"
                await anyio.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.kill()


def survivor(kind: str, url: str, prefix: str, handled: list[tuple[str, float]]) -> Bus:
    bus = Bus(
        transport=make_transport(kind, url, prefix, ack_timeout=ACK_TIMEOUT),
        middleware=[deduplicate(lease=LEASE)],
    )

    @bus.subscribe("work.items", group="workers")
    async def handle(envelope: Envelope) -> None:
        handled.append((envelope.id, time.monotonic()))

    return bus


@on_shared_claims
async def test_a_redelivery_after_a_crash_past_the_handling_is_skipped_in_another_process(
    kind: str, url: str, unique_prefix: str, tmp_path: Path, workers: list[Worker]
) -> None:
    worker = Worker(kind, url, unique_prefix, tmp_path, "die-after-done")
    workers.append(worker)
    await worker.wait_ready()
    async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
        await publisher.publish("work.items", "pay", id="charge-1")
    await worker.wait_for("done charge-1")
    assert worker.process.wait(10) == -signal.SIGKILL  # died before its bus acked

    handled: list[tuple[str, float]] = []
    bus = survivor(kind, url, unique_prefix, handled)
    with anyio.fail_after(40):
        async with bus:
            # The redelivery comes after ack_timeout; drain waits for the broker too.
            while not bus.statistics().stage("work.items@workers").acked:
                await anyio.sleep(0.05)
            await bus.drain(20)
            stats = bus.statistics().stage("work.items@workers")
    assert handled == []  # skipped as a duplicate, and acked
    assert (stats.published, stats.acked, stats.dead_lettered) == (1, 1, 0)
    assert worker.events() == ["started charge-1", "done charge-1"]


@on_shared_claims
async def test_work_claimed_by_a_process_that_died_is_done_by_the_survivor_after_the_lease(
    kind: str, url: str, unique_prefix: str, tmp_path: Path, workers: list[Worker]
) -> None:
    worker = Worker(kind, url, unique_prefix, tmp_path, "hang")
    workers.append(worker)
    await worker.wait_ready()
    async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
        await publisher.publish("work.items", "render", id="render-1")
    await worker.wait_for("started render-1")
    worker.kill()  # mid-work, holding the claim
    killed_at = time.monotonic()

    handled: list[tuple[str, float]] = []
    bus = survivor(kind, url, unique_prefix, handled)
    with anyio.fail_after(40):
        async with bus:
            while not handled:
                await anyio.sleep(0.05)
            await bus.drain(20)
    ((envelope_id, at),) = handled  # once
    assert envelope_id == "render-1"
    # Redelivered after ack_timeout, it waited for the dead owner's claim to expire:
    # at least two thirds of the lease after the kill (extended every third).
    assert at - killed_at >= LEASE * 2 / 3 - 0.2, at - killed_at
    assert worker.events() == ["started render-1"]
