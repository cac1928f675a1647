"""Over a broker the dead letters are one list, whichever process looks, replays or purges.

Every process's ``bus.dead_letters`` shows every process's entries (kept up to date
from the broker, exact after ``await bus.dead_letters.refresh()``); a replay or a
purge of any entry works from any process; and the broker's removal is the claim, so
an entry is replayed once however many processes (or stale lists) ask.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from _brokers import SHARED_PORTS, make_transport, url_for  # type: ignore[import-not-found]
from _processes import stop  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import HEADER_REPLAYED, Bus, DeadLetterReason, Envelope
from asyncbus.integrations.starlette import admin_app

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

WORKER = Path(__file__).with_name("_dead_letter_worker.py")
#: Seconds within which a process's list shows another process's change (the bound is
#: far shorter on a quiet machine; this one is for a loaded CI runner).
SEEN_WITHIN = 10.0
N = 38  # dead letters per process


class _Process:
    """One bus over the broker, as one process of a service would have: its handler on
    ``jobs.<name>`` fails until the envelope is replayed."""

    def __init__(self, kind: str, url: str, prefix: str, name: str) -> None:
        self.name = name
        self.bus = Bus(transport=make_transport(kind, url, prefix), name=name)
        self.handled: Counter[str] = Counter()
        self.bus.subscribe(f"jobs.{name}", self.handle, group=name, concurrency=4)

    async def handle(self, envelope: Envelope) -> None:
        self.handled[envelope.id] += 1
        if HEADER_REPLAYED not in envelope.headers:
            raise RuntimeError(f"job {envelope.payload} failed")

    def ids(self) -> set[str]:
        return {entry.envelope.id for entry in self.bus.dead_letters.list()}


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for another process's change to reach this one (there is no event to await
    for that: the broker tells every process in its own time, within the bound)."""
    with anyio.move_on_after(SEEN_WITHIN):
        while not condition():
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"not within {SEEN_WITHIN} s: {what}")


@contextlib.asynccontextmanager
async def two_processes(
    kind: str, url: str, prefix: str
) -> AsyncIterator[tuple[_Process, _Process, dict[str, set[str]]]]:
    """Processes ``a`` and ``b`` on one prefix, running, each with ``N`` dead letters of
    its own; their ids by process."""
    a = _Process(kind, url, prefix, "a")
    b = _Process(kind, url, prefix, "b")
    with anyio.fail_after(90):
        async with a.bus, b.bus:
            yield a, b, await _fail_jobs(a, b)


async def _fail_jobs(*processes: _Process) -> dict[str, set[str]]:
    """Each process publishes and dead-letters ``N`` jobs of its own; their ids, by process."""
    made: dict[str, set[str]] = {}
    for process in processes:
        receipts = await process.bus.publish_many(f"jobs.{process.name}", list(range(N)))
        made[process.name] = {receipt.id for receipt in receipts}
    for process in processes:
        await process.bus.drain(20)
    return made


async def test_every_process_lists_every_dead_letter_and_replays_anyone_s_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    async with two_processes(kind, url, unique_prefix) as (a, b, made):
        everything = made["a"] | made["b"]
        # Each process sees both processes' dead letters, without being asked...
        await until(lambda: a.ids() == everything, "a lists b's dead letters")
        await until(lambda: b.ids() == everything, "b lists a's dead letters")
        # ...and exactly after a refresh.
        for process in (a, b):
            await process.bus.dead_letters.refresh()
            assert len(process.bus.dead_letters) == 2 * N
            assert process.ids() == everything
        theirs = sorted(made["b"])[:5]
        assert a.bus.dead_letters.get(theirs[0]) is not None
        assert a.bus.dead_letters.get(theirs[0]).stage == "jobs.b@b"  # type: ignore[union-attr]

        # a replays b's entries: they go to b's group, and leave every list.
        receipts = await a.bus.dead_letters.replay(*theirs)
        assert [receipt.accepted for receipt in receipts] == [("jobs.b@b",)] * 5
        await b.bus.drain(20)
        assert [b.handled[id] for id in theirs] == [2] * 5  # the failure, the replay
        left = everything - set(theirs)
        await until(lambda: b.ids() == left, "b forgets what a replayed")
        assert a.ids() == left

        # b, asked to replay them again (a stale list, a second click): nothing.
        with pytest.raises(KeyError, match="not in the dead-letter queue"):
            await b.bus.dead_letters.replay(theirs[0])
        with pytest.raises(KeyError, match="not in the dead-letter queue"):
            await a.bus.dead_letters.replay(theirs[1])
        await b.bus.drain(20)
        assert [b.handled[id] for id in theirs] == [2] * 5

        # And the other way round: b replays an entry of a.
        mine = sorted(made["a"])[0]
        (receipt,) = await b.bus.dead_letters.replay(mine)
        assert receipt.accepted == ("jobs.a@a",)
        await a.bus.drain(20)
        assert a.handled[mine] == 2

        # The broker holds what the lists showed.
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            stored = {entry.envelope.id for entry in console.dead_letters.list()}
            assert stored == everything - set(theirs) - {mine}
            assert len(console.dead_letters) == 2 * N - 6


async def test_concurrent_replays_of_one_entry_from_two_processes_send_it_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    outcomes: Counter[str] = Counter()
    async with two_processes(kind, url, unique_prefix) as (a, b, made):
        for process in (a, b):
            await process.bus.dead_letters.refresh()

        async def replay(process: _Process, id: str) -> None:
            try:
                await process.bus.dead_letters.replay(id)
            except KeyError:
                outcomes["refused"] += 1
            else:
                outcomes["replayed"] += 1

        async with anyio.create_task_group() as group:
            for id in sorted(made["a"] | made["b"]):
                group.start_soon(replay, a, id)
                group.start_soon(replay, b, id)
        await a.bus.drain(20)
        await b.bus.drain(20)
        assert outcomes == {"replayed": 2 * N, "refused": 2 * N}
        for process in (a, b):
            assert sorted(process.handled.values()) == [2] * N  # each replayed once
            stage = process.bus.statistics().stage(f"jobs.{process.name}@{process.name}")
            assert (stage.published, stage.acked, stage.dead_lettered) == (2 * N, N, N)
        await until(lambda: not a.ids() and not b.ids(), "both lists are empty")


async def test_a_purge_from_one_process_empties_every_list(
    kind: str, url: str, unique_prefix: str
) -> None:
    async with two_processes(kind, url, unique_prefix) as (a, b, made):
        await until(lambda: len(a.bus.dead_letters) == 2 * N, "a lists all")
        one, two = sorted(made["b"])[:2]
        assert a.bus.dead_letters.purge(one, two) == 2  # b's entries, from a
        await a.bus.drain(20)  # the broker's copies are removed in the background
        await until(lambda: {one, two}.isdisjoint(b.ids()), "b forgets the purged ones")
        await b.bus.dead_letters.refresh()
        assert len(b.bus.dead_letters) == 2 * N - 2
        with pytest.raises(KeyError):
            await b.bus.dead_letters.replay(one)

        assert b.bus.dead_letters.purge() == 2 * N - 2  # everything, everyone's
        await b.bus.drain(20)
        await until(lambda: len(a.bus.dead_letters) == 0, "a's list empties")
        await a.bus.dead_letters.refresh()
        assert len(a.bus.dead_letters) == 0
        assert sum(a.handled.values()) + sum(b.handled.values()) == 2 * N  # none replayed


async def test_the_admin_app_of_any_process_shows_and_replays_every_process_s_entries(
    kind: str, url: str, unique_prefix: str
) -> None:
    async with two_processes(kind, url, unique_prefix) as (a, b, made):
        clients = {
            process.name: httpx.AsyncClient(
                transport=httpx.ASGITransport(app=admin_app(process.bus)),
                base_url="http://testserver",
            )
            for process in (a, b)
        }
        try:
            await until(lambda: len(a.bus.dead_letters) == 2 * N, "a lists all")
            page = (await clients["a"].get("/dead-letters?limit=1000")).json()
            assert (page["total"], page["queue_length"]) == (2 * N, 2 * N)
            assert page["by_reason"][DeadLetterReason.HANDLER_FAILED] == 2 * N
            assert {item["id"] for item in page["items"]} == made["a"] | made["b"]

            theirs = sorted(made["b"])[0]
            answer = await clients["a"].post("/dead-letters/replay", json={"ids": [theirs]})
            assert answer.status_code == 200, answer.text
            assert answer.json()["receipts"][0]["accepted"] == ["jobs.b@b"]
            await b.bus.drain(20)
            again = await clients["b"].post("/dead-letters/replay", json={"ids": [theirs]})
            assert again.status_code == 404, again.text
            assert again.json()["unknown_ids"] == [theirs]
            await b.bus.drain(20)
            assert b.handled[theirs] == 2

            # b's own entry, which a has not purged before: purged through a.
            other = sorted(made["b"])[1]
            purged = await clients["a"].post("/dead-letters/purge", json={"ids": [other]})
            assert purged.json() == {"purged": 1}
            await a.bus.drain(20)
            gone = await clients["a"].get(f"/dead-letters/{other}")
            assert gone.status_code == 404
            await b.bus.dead_letters.refresh()
            assert b.bus.dead_letters.get(other) is None
        finally:
            for client in clients.values():
                await client.aclose()


class _Worker:
    """A ``_dead_letter_worker.py`` process."""

    def __init__(self, kind: str, url: str, prefix: str, folder: Path, name: str) -> None:
        self.name = name
        self.out = folder / f"{name}.txt"
        self.ready = folder / f"{name}.ready"
        self.count = folder / f"{name}.ready.count"
        self.out.touch()
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), kind, url, prefix, name, str(self.out), str(self.ready)]
        )

    async def wait_ready(self) -> None:
        with anyio.fail_after(30):
            while not self.ready.exists():
                assert self.process.poll() is None, "worker exited early"
                await anyio.sleep(0.05)

    async def listed(self) -> int:
        """How many dead letters the worker's own list holds now."""
        self.count.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        with anyio.fail_after(10):
            while not self.count.exists():
                await anyio.sleep(0.01)
        return int(self.count.read_text())

    def handled(self) -> list[str]:
        return self.out.read_text().split()

    def stop(self) -> None:
        stop(self.process)


@pytest.fixture
def workers() -> Iterator[list[_Worker]]:
    started: list[_Worker] = []
    yield started
    for worker in started:
        worker.stop()


async def test_processes_share_one_dead_letter_list_and_a_replay_runs_once(
    kind: str, url: str, unique_prefix: str, tmp_path: Path, workers: list[_Worker]
) -> None:
    workers += [_Worker(kind, url, unique_prefix, tmp_path, name) for name in ("w1", "w2")]
    for worker in workers:
        await worker.wait_ready()
    with anyio.fail_after(90):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            made: dict[str, list[str]] = {}
            for worker in workers:
                receipts = await console.publish_many(f"jobs.{worker.name}", list(range(N)))
                made[worker.name] = [receipt.id for receipt in receipts]
            # Each worker dead-letters its own N; each lists all 2N.
            for worker in workers:
                with anyio.fail_after(SEEN_WITHIN * 2):
                    while await worker.listed() != 2 * N:
                        await anyio.sleep(0.05)
            await console.dead_letters.refresh()
            assert len(console.dead_letters) == 2 * N

            # The console replays one entry of each worker, then (its list stale, or a
            # second operator) the same again: refused, nothing sent twice.
            chosen = [made["w1"][0], made["w2"][0]]
            receipts = await console.dead_letters.replay(*chosen)
            assert [r.accepted for r in receipts] == [("jobs.w1@w1",), ("jobs.w2@w2",)]
            with pytest.raises(KeyError):
                await console.dead_letters.replay(chosen[0])
            with anyio.fail_after(SEEN_WITHIN * 2):
                while [w.handled() for w in workers] != [[chosen[0]], [chosen[1]]]:
                    await anyio.sleep(0.05)
            for worker in workers:
                with anyio.fail_after(SEEN_WITHIN * 2):
                    while await worker.listed() != 2 * N - 2:
                        await anyio.sleep(0.05)
    for worker in workers:
        worker.stop()
    assert [worker.handled() for worker in workers] == [[chosen[0]], [chosen[1]]]


async def test_a_list_that_lost_its_broker_catches_up_once_it_is_back(
    kind: str, url: str, unique_prefix: str
) -> None:
    """What another process dead-letters while this one cannot reach the broker shows
    in this one's list once the broker answers again (it reads everything again)."""
    with TcpProxy(SHARED_PORTS[kind]) as proxy:
        cut_off = Bus(
            transport=make_transport(
                kind, url_for(kind, proxy.port), unique_prefix, publish_timeout=1.5
            )
        )
        b = _Process(kind, url, unique_prefix, "b")
        with anyio.fail_after(90):
            async with cut_off, b.bus:
                proxy.refuse()
                receipts = await b.bus.publish_many("jobs.b", list(range(N)))
                await b.bus.drain(20)
                assert len(cut_off.dead_letters) == 0
                proxy.forward()
                made = {receipt.id for receipt in receipts}
                await until(
                    lambda: {e.envelope.id for e in cut_off.dead_letters.list()} == made,
                    "the list catches up after the outage",
                )
                # And it follows again: b's replay of one reaches it.
                first = sorted(made)[0]
                await b.bus.dead_letters.replay(first)
                await until(lambda: cut_off.dead_letters.get(first) is None, "the replay")
