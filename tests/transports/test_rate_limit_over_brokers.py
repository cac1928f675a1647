"""RateLimit over a broker that keeps its turns (Redis, NATS, PostgreSQL): every replica
of a group draws from the same buckets, so the limit holds for the group, counted
exactly; over a broker that does not answer, each process limits on its own meanwhile."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import anyio
import pytest
from _brokers import make_transport, names  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, RateLimit
from asyncbus._rates import RateStore
from asyncbus.transports import RateStoreProvider

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: The brokers that keep RateLimit's turns.
on_shared_rates = pytest.mark.parametrize("kind", names("rate_store"), indirect=True)

REPLICAS = 3


@on_shared_rates
async def test_replicas_share_one_bucket_so_the_group_keeps_the_limit(
    kind: str, url: str, unique_prefix: str
) -> None:
    handled: list[tuple[str, Any]] = []
    done = anyio.Event()
    total = 10

    def replica(number: int) -> Bus:
        bus = Bus(transport=make_transport(kind, url, unique_prefix), name=f"replica-{number}")

        async def send(envelope: Envelope) -> None:
            handled.append((bus.name, envelope.payload))
            if len(handled) == total:
                done.set()

        # two back to back, then one every half second, for the group as a whole
        bus.subscribe("emails", send, group="mailer", middleware=[RateLimit(2, per=1.0, burst=2)])
        return bus

    buses = [replica(number) for number in range(REPLICAS)]
    assert isinstance(buses[0].transport, RateStoreProvider)
    with anyio.fail_after(40):
        async with buses[0], buses[1], buses[2]:
            for n in range(total):
                await buses[0].publish("emails", n)
            await done.wait()
            for bus in buses:
                await bus.drain(timeout=10)
            stages = [bus.statistics().stage("emails@mailer") for bus in buses]
    assert sorted(payload for _, payload in handled) == list(range(total))
    # The burst ran at once, every other envelope waited for its turn once. (Limited
    # per process, each replica's burst would have run: 3 x 2 at once, 4 deferred.)
    assert sum(stage.deferred for stage in stages) == total - 2
    assert sum(stage.acked for stage in stages) == total
    assert sum(stage.failed + stage.dead_lettered for stage in stages) == 0


@on_shared_rates
async def test_turns_taken_at_once_from_several_processes_are_each_given_once(
    kind: str, url: str, unique_prefix: str
) -> None:
    transports = [make_transport(kind, url, unique_prefix) for _ in range(REPLICAS)]
    interval = 10.0  # long: every turn taken below is due long after the calls end
    waits: list[float] = []
    with anyio.fail_after(30):
        async with transports[0], transports[1], transports[2]:
            stores: list[RateStore] = [t.rate_store() for t in transports]  # type: ignore[attr-defined]

            async def take(store: RateStore) -> None:
                waits.append(await store.take("stage/bucket", interval, 3))

            async with anyio.create_task_group() as tasks:
                for turn in range(30):
                    tasks.start_soon(take, stores[turn % REPLICAS])
    # 3 due now, then one per interval: each turn given once (never two alike)
    turns = sorted(round(wait / interval) for wait in waits)
    assert Counter(turns) == Counter([0, 0, 0, *range(1, 28)])


async def test_a_broker_that_cannot_be_asked_leaves_each_process_its_own_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Unreachable:
        async def take(self, key: str, interval: float, burst: int) -> float:
            from asyncbus import TransportError

            raise TransportError("the broker is down")

    limit = RateLimit(1, per=60.0, burst=1)
    with caplog.at_level(logging.WARNING, "asyncbus.rate_limit"):
        first = await limit._take("emails@mailer", None, 0.0, Unreachable())
        second = await limit._take("emails@mailer", None, 0.0, Unreachable())
    assert (first, second) == (0.0, 60.0)  # this process's bucket: one, then a minute
    [warning] = [record.getMessage() for record in caplog.records]
    assert "this process limits on its own meanwhile: the broker is down" in warning


@on_shared_rates
async def test_a_bucket_holding_what_the_store_did_not_write_counts_as_new(
    kind: str, url: str, unique_prefix: str
) -> None:
    import hashlib

    name = hashlib.sha256(b"stage/bucket").hexdigest()[:40]
    async with make_transport(kind, url, unique_prefix) as transport:
        store: RateStore = transport.rate_store()  # type: ignore[attr-defined]
        assert await store.take("stage/bucket", 10.0, 1) == 0.0  # (the bucket exists)
        garbage = b"\xff not a number"
        if kind == "redis":
            await transport._redis().set(f"{unique_prefix}:rate:{name}", garbage)  # type: ignore[attr-defined]
        elif kind == "postgres":
            # (its column takes numbers only: what is no TAT there is a NaN or an infinity)
            rates = f"{transport.schema}.rates"  # type: ignore[attr-defined]
            await transport.run("garbling", "execute", f"UPDATE {rates} SET tat = 'NaN'")  # type: ignore[attr-defined]
        else:
            await store._kv.call(lambda kv: kv.put(name, garbage))  # type: ignore[attr-defined]
        # read as a new bucket: its burst of one is due now, the next a turn later
        assert await store.take("stage/bucket", 10.0, 1) == 0.0
        assert 9.0 < await store.take("stage/bucket", 10.0, 1) <= 10.0
