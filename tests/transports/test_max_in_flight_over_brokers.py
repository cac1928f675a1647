"""``max_in_flight`` over a broker that keeps leases (Redis, NATS, PostgreSQL): the
replicas of a group share its slots, counted exactly; a slot whose holder died comes back
once its lease runs out; a broker that does not answer leaves each process its own bound."""

from __future__ import annotations

import logging

import anyio
import pytest
from _brokers import make_transport, names  # type: ignore[import-not-found]

from asyncbus import Bus
from asyncbus._leases import LeaseStore
from asyncbus.transports import LeaseStoreProvider

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

on_shared_leases = pytest.mark.parametrize("kind", names("lease_store"), indirect=True)

REPLICAS = 3


@on_shared_leases
async def test_replicas_share_the_groups_slots(kind: str, url: str, unique_prefix: str) -> None:
    running = most = handled = 0
    bound = 2
    reached = anyio.Event()
    total = 24

    def replica(number: int) -> Bus:
        bus = Bus(transport=make_transport(kind, url, unique_prefix), name=f"replica-{number}")

        async def call_downstream(n: int) -> None:
            nonlocal running, most, handled
            running += 1
            most = max(most, running)
            if running == bound:
                reached.set()
            await reached.wait()
            await anyio.sleep(0.01)
            running -= 1
            handled += 1

        bus.subscribe("calls", call_downstream, group="g", concurrency=4, max_in_flight=bound)
        return bus

    buses = [replica(number) for number in range(REPLICAS)]
    assert isinstance(buses[0].transport, LeaseStoreProvider)
    with anyio.fail_after(45):
        async with buses[0], buses[1], buses[2]:
            await buses[0].publish_many("calls", range(total))
            while handled < total:
                await anyio.sleep(0.01)
            for bus in buses:
                await bus.drain(timeout=10)
            stages = [bus.statistics().stage("calls@g") for bus in buses]
    # Each replica alone would allow two at once: three replicas, six. The group: two.
    assert most == bound
    assert sum(stage.acked for stage in stages) == total
    assert {(stage.slots_held, stage.slots_waiting) for stage in stages} == {(0, 0)}


@on_shared_leases
async def test_a_dead_holders_slot_comes_back_when_its_lease_runs_out(
    kind: str, url: str, unique_prefix: str
) -> None:
    transport = make_transport(kind, url, unique_prefix)
    with anyio.fail_after(30):
        async with transport:
            store: LeaseStore = transport.lease_store()
            assert await store.acquire("s@g", 2, "dead-1", 0.5)
            assert await store.acquire("s@g", 2, "alive", 30.0)
            assert not await store.acquire("s@g", 2, "late", 30.0)
            assert await store.acquire("s@g", 2, "alive", 30.0)  # (held: taken again)
            assert await store.renew("s@g", ["alive", "never"], 30.0) == 1
            # dead-1 never renews: its slot is free once its lease ran out.
            while not await store.acquire("s@g", 2, "late", 30.0):
                await anyio.sleep(0.05)
            assert await store.renew("s@g", ["dead-1", "alive", "late"], 30.0) == 2
            await store.release("s@g", "alive")
            assert await store.acquire("s@g", 2, "next", 30.0)
            assert not await store.acquire("s@g", 2, "more", 30.0)
            await store.release("s@g", "never")  # (not a holder: nothing happens)
            assert not await store.acquire("s@g", 2, "more", 30.0)
            # Another stage's slots are its own.
            assert await store.acquire("other@g", 1, "more", 30.0)


async def test_a_broker_that_cannot_be_asked_leaves_each_process_its_own_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from asyncbus import TransportError
    from asyncbus._flights import FlightLimit

    class Unreachable:
        async def acquire(self, name: str, limit: int, holder: str, lease: float) -> bool:
            raise TransportError("the broker is down")

        async def renew(self, name: str, holders: list[str], lease: float) -> int:
            raise TransportError("the broker is down")

        async def release(self, name: str, holder: str) -> None:
            raise TransportError("the broker is down")

    flights = FlightLimit("calls@g", 2)
    flights._chosen, flights._store = True, Unreachable()
    running = most = 0
    reached = anyio.Event()

    async def chain(n: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        if running == 2:
            reached.set()
        await reached.wait()
        running -= 1
        return n

    handle = flights(chain)
    results: list[int] = []

    async def one(n: int) -> None:
        results.append(await handle(n))

    with caplog.at_level(logging.WARNING, "asyncbus.flights"), anyio.fail_after(10):
        async with anyio.create_task_group() as tasks:
            for n in range(6):
                tasks.start_soon(one, n)
    assert sorted(results) == list(range(6))
    assert most == 2  # this process's own bound, meanwhile
    [warning] = [record.getMessage() for record in caplog.records]
    assert "this process limits on its own (2 at once) meanwhile: the broker is down" in warning
