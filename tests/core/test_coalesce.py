"""The group commit behind the broker publishes: batching, errors, closing, cancellation."""

from __future__ import annotations

import anyio
import anyio.abc
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


async def _submit_then_write(
    coalescer: Coalescer[int], task_group: anyio.abc.TaskGroup, items: range
) -> dict[int, BaseException | None]:
    """Submit ``items`` from concurrent tasks, and start the writer once all of them wait.

    (Which task a scheduler runs first is its own choice: trio shuffles them under
    hypothesis. Starting the writer after every submit waits makes "everything that
    waited when the writer came" the same set on every backend.)
    """
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as submitters:
        for item in items:
            submitters.start_soon(submit, item)
        await anyio.wait_all_tasks_blocked()
        task_group.start_soon(coalescer.run)
    return results


async def test_concurrent_submits_go_in_one_write() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    async with anyio.create_task_group() as task_group:
        results = await _submit_then_write(coalescer, task_group, range(100))
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
        failed = await _submit_then_write(coalescer, task_group, range(3))
        # The writer is idle again: two more submits wake it together.
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


async def test_batches_are_bounded_in_items_and_in_size() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write, max_items=3, max_size=100)
    results: dict[int, BaseException | None] = {}

    async def submit(item: int, size: int) -> None:
        results[item] = await coalescer.submit(item, size)

    async with anyio.create_task_group() as task_group:
        for item in range(7):  # 3 + 3 + 1 by count
            task_group.start_soon(submit, item, 1)
        await anyio.wait_all_tasks_blocked()
        for item, size in ((10, 60), (11, 60), (12, 500)):  # by size; an outsize one alone
            task_group.start_soon(submit, item, size)
            await anyio.wait_all_tasks_blocked()  # one at a time: in this order on trio too
        task_group.start_soon(coalescer.run)
        with anyio.fail_after(5):
            while len(results) < 10:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
        task_group.cancel_scope.cancel()
    # The 7th item opens a batch that 10 joins (61 bytes); 11 would make it 121 > 100.
    assert [len(batch) for batch in writer.batches] == [3, 3, 2, 1, 1]
    assert writer.batches[2][1:] + writer.batches[3] + writer.batches[4] == [10, 11, 12]
    assert sorted(item for batch in writer.batches for item in batch) == [*range(7), 10, 11, 12]
    assert set(results.values()) == {None}


async def test_a_caller_cancelled_before_the_write_takes_its_item_back() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as task_group:
        with anyio.CancelScope() as cancelled:
            async with anyio.create_task_group() as doomed:
                doomed.start_soon(submit, 1)
                await anyio.wait_all_tasks_blocked()
                cancelled.cancel()
        task_group.start_soon(submit, 2)
        await anyio.wait_all_tasks_blocked()
        task_group.start_soon(coalescer.run)
        with anyio.fail_after(5):
            while 2 not in results:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
        task_group.cancel_scope.cancel()
    assert writer.batches == [[2]]
    assert results == {2: None}


async def test_when_the_writer_stops_nothing_waits_forever() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(coalescer.run)
        await anyio.wait_all_tasks_blocked()
        task_group.cancel_scope.cancel()  # the writer dies without anyone calling close()
    with anyio.fail_after(5):
        error = await coalescer.submit(1)
    assert isinstance(error, TransportError)
    assert "writer stopped" in str(error)
    assert writer.batches == []


async def test_a_write_past_the_timeout_fails_its_batch_with_timeout_error() -> None:
    writer = Writer()
    writer.hold = anyio.Event()  # never set: the server does not answer
    coalescer: Coalescer[int] = Coalescer(writer.write, timeout=0.2)
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(coalescer.run)
        with anyio.fail_after(5):
            error = await coalescer.submit(1)
        task_group.cancel_scope.cancel()
    assert isinstance(error, TimeoutError)
    assert writer.batches == [[1]]


async def test_a_batch_whose_deadline_passed_before_its_write_is_failed_unwritten() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write, timeout=0.05)
    results: dict[int, BaseException | None] = {}

    async def submit(item: int) -> None:
        results[item] = await coalescer.submit(item)

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(submit, 1)
        await anyio.wait_all_tasks_blocked()
        await anyio.sleep(0.1)  # the time passes (no writer yet): the deadline is gone
        task_group.start_soon(coalescer.run)
        with anyio.fail_after(5):
            while not results:
                await anyio.wait_all_tasks_blocked()
                await anyio.lowlevel.checkpoint()
        task_group.cancel_scope.cancel()
    assert writer.batches == []  # never handed to the writer
    assert isinstance(results[1], TimeoutError)


async def test_a_write_within_the_timeout_succeeds() -> None:
    writer = Writer()
    coalescer: Coalescer[int] = Coalescer(writer.write, timeout=30)
    async with anyio.create_task_group() as task_group:
        results = await _submit_then_write(coalescer, task_group, range(5))
        task_group.cancel_scope.cancel()
    assert results == dict.fromkeys(range(5))
    assert [sorted(batch) for batch in writer.batches] == [list(range(5))]
