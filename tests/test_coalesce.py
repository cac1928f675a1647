"""The group commit behind the broker publishes: batching, errors, closing, cancellation."""

from __future__ import annotations

import anyio
import pytest

from asyncbus import TransportError
from asyncbus.transports._coalesce import Coalescer

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


class Writer:
    """Records every batch; can hold a write open, or fail the next one."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.hold: anyio.Event | None = None
        self.started = anyio.Event()
        self.fail_next: Exception | None = None

    async def write(self, items: list[int]) -> None:
        self.batches.append(list(items))
        self.started.set()
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error


async def _submit_all(coalescer: Coalescer[int], items: range) -> dict[int, BaseException | None]:
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as task_group:
        for item in items:
            task_group.start_soon(submit, item)
    return results


async def test_concurrent_submits_go_in_one_write() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(coalescer.run)
        results = await _submit_all(coalescer, range(100))
        task_group.cancel_scope.cancel()
    # (in the order the tasks ran: trio does not run new tasks in start order)
    assert [sorted(batch) for batch in writer.batches] == [list(range(100))]
    assert results == dict.fromkeys(range(100))


async def test_what_arrives_during_a_write_goes_in_the_next_one() -> None:
    writer = Writer()
    writer.hold = anyio.Event()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(coalescer.run)
        task_group.start_soon(submit, 0)
        await writer.started.wait()  # the write of [0] is in flight
        for item in (1, 2, 3):
            task_group.start_soon(submit, item)
        await anyio.wait_all_tasks_blocked()
        assert writer.batches == [[0]] and results == {}
        writer.hold.set()
        with anyio.fail_after(5):
            while len(results) < 4:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
        task_group.cancel_scope.cancel()
    assert [sorted(batch) for batch in writer.batches] == [[0], [1, 2, 3]]
    assert results == dict.fromkeys(range(4))


async def test_a_failed_write_fails_its_batch_only() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    boom = RuntimeError("server said no")
    writer.fail_next = boom
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(coalescer.run)
        failed = await _submit_all(coalescer, range(3))
        succeeded = await _submit_all(coalescer, range(3, 5))
        task_group.cancel_scope.cancel()
    assert failed == dict.fromkeys(range(3), boom)
    assert succeeded == dict.fromkeys(range(3, 5))
    assert [sorted(batch) for batch in writer.batches] == [[0, 1, 2], [3, 4]]


async def test_close_fails_waiting_items_and_refuses_new_ones() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)  # no writer task: nothing is written
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(submit, 1)
        await anyio.wait_all_tasks_blocked()
        coalescer.close("closed for the test")
    later = await coalescer.submit(2)
    assert writer.batches == []
    assert [str(error) for error in (results[1], later)] == ["closed for the test"] * 2
    assert all(isinstance(error, TransportError) for error in (results[1], later))


async def test_a_write_cancelled_midway_is_reported_as_unknown() -> None:
    writer = Writer()
    writer.hold = anyio.Event()  # never set: the write hangs until cancelled
    coalescer: Coalescer[int] = Coalescer(writer.write)
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as outer:
        outer.start_soon(submit, 7)
        async with anyio.create_task_group() as writer_group:
            writer_group.start_soon(coalescer.run)
            await writer.started.wait()
            writer_group.cancel_scope.cancel()
        coalescer.close("closed")
    assert list(results) == [7]
    error = results[7]
    assert isinstance(error, TransportError)
    assert "may or may not have been written" in str(error)
