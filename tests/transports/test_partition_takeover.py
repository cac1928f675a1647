"""Partitions served by real processes (``_partition_worker.py``) over every broker: a
replica killed with SIGKILL mid-run and another joining, while keys are published. Each
worker writes when it starts and ends each handling; from those lines the test proves
that no key was handled by two processes at once, that every key's envelopes were
handled in publish order (what the killed replica handled without its ack reaching the
broker is handled again, where it was), and that none was lost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import anyio
import pytest
from _brokers import BROKERS  # type: ignore[import-not-found]
from _processes import stop  # type: ignore[import-not-found]

from asyncbus import Bus

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(150)]

WORKER = Path(__file__).with_name("_partition_worker.py")
KEYS = 16


class Replica:
    """One worker process and the lines it wrote."""

    def __init__(self, kind: str, url: str, prefix: str, folder: Path, name: str) -> None:
        self.name = name
        self.out = folder / f"{name}.txt"
        self.ready = folder / f"{name}.ready"
        self.out.touch()
        arguments = [sys.executable, str(WORKER), kind, url, prefix, str(self.out), str(self.ready)]
        self.process = subprocess.Popen(arguments)
        self.killed_at: float | None = None

    def lines(self) -> list[tuple[str, int, int, float]]:
        rows = [line.split() for line in self.out.read_text().splitlines()]
        return [(r[0], int(r[1]), int(r[2]), float(r[3])) for r in rows if len(r) == 4]

    async def wait_ready(self) -> None:
        with anyio.fail_after(40):
            while not self.ready.exists():
                assert self.process.poll() is None, f"replica {self.name} exited early"
                await anyio.sleep(0.05)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.killed_at = time.time()


@pytest.fixture
def replicas() -> Iterator[list[Replica]]:
    started: list[Replica] = []
    yield started
    for replica in started:
        stop(replica.process)


def spans(
    replicas: list[Replica], final: bool = True
) -> dict[int, list[tuple[float, float, str, int, bool]]]:
    """Per key: (start, end, replica, n, ended) of every handling, by start; a handling
    the killed replica never ended lasts until it was killed (one under way in a live
    replica is left out until ``final``, when there must be none)."""
    found: dict[int, list[tuple[float, float, str, int, bool]]] = defaultdict(list)
    for replica in replicas:
        open_: dict[tuple[int, int], float] = {}
        for kind, key, n, at in replica.lines():
            if kind == "start":
                open_[key, n] = at
            else:
                found[key].append((open_.pop((key, n)), at, replica.name, n, True))
        for (key, n), began in open_.items():
            if not final and replica.killed_at is None:
                continue
            assert replica.killed_at is not None, f"{replica.name} left {key}/{n} unended"
            found[key].append((began, replica.killed_at, replica.name, n, False))
    for key in found:
        found[key].sort()
    return found


async def test_a_killed_replica_s_partitions_are_taken_over_in_order_and_never_shared(
    kind: str, url: str, unique_prefix: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    replicas += [Replica(kind, url, unique_prefix, tmp_path, name) for name in ("a", "b")]
    for replica in replicas:
        await replica.wait_ready()
    publisher = Bus(transport=BROKERS[kind].make(url, unique_prefix))
    each = 30
    async with publisher:
        for n in range(each):
            for key in range(KEYS):
                await publisher.publish("orders", [key, n], key=f"k{key}")
            if n == 10:
                replicas[0].kill()  # mid-run: what it held comes back to the new owner
            if n == 15:
                replicas.append(Replica(kind, url, unique_prefix, tmp_path, "c"))
                await replicas[-1].wait_ready()
            await anyio.sleep(0.05)
    with anyio.fail_after(90):
        while True:
            found = spans(replicas, final=False)
            done = {(key, n) for key, rows in found.items() for _, _, _, n, ended in rows if ended}
            if len(done) == KEYS * each:
                break
            await anyio.sleep(0.1)
    for replica in replicas[1:]:
        stop(replica.process)
    found = spans(replicas)
    for key, rows in found.items():
        # Never two processes on one key at once.
        for before, after in pairwise(rows):
            assert before[1] <= after[0], (key, before, after)
        # In publish order: what the killed replica handled without its ack reaching
        # the broker is handled again by the next owner (at least once), which starts
        # from there; leaving those first tries out, each key is 0, 1, 2, ... once.
        killed = replicas[0].name
        redone = {n for _, _, name, n, _ in rows if name != killed}
        order = [
            n for _, _, name, n, ended in rows if ended and not (name == killed and n in redone)
        ]
        assert order == list(range(each)), (key, rows)
        unfinished = [n for _, _, name, n, ended in rows if not ended]
        assert len(unfinished) <= 1, (key, unfinished)
    served = {name for rows in found.values() for _, _, name, _, _ in rows}
    assert served == {"a", "b", "c"}  # the killed one served, and the one that joined
