"""The bus's one dispatch path over a transport that is not bypassed.

``MemoryTransport(direct=False)`` makes the bus go through the transport exactly as it
goes through a broker (pumps, deliveries acked or rejected, dead letters kept by the
transport), on every backend and without a server. The broker transports run the same
behaviours in their own modules.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, HandlerError, Retry
from asyncbus.testing import capture
from asyncbus.transports import MemoryTransport

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio", "uvloop", "trio")]


def ledger_exact(bus: Bus) -> None:
    for stage in bus.statistics().stages:
        assert stage.published == (
            stage.acked + stage.dead_lettered + stage.abandoned + stage.depth + stage.in_flight
        ), stage


async def test_fan_out_and_competing_consumers_go_through_the_transport() -> None:
    transport = MemoryTransport(direct=False)
    bus = Bus(transport=transport)
    audited: list[int] = []
    worked: dict[str, list[int]] = {"one": [], "two": []}

    @bus.subscribe("orders.*", group="audit")
    async def audit(n: int) -> None:
        audited.append(n)

    @bus.subscribe("orders.created", group="work", concurrency=2)
    async def work_one(n: int) -> None:
        worked["one"].append(n)

    @bus.subscribe("orders.created", group="work", concurrency=2)
    async def work_two(n: int) -> None:
        worked["two"].append(n)

    with anyio.fail_after(10):
        async with bus:
            for n in range(200):
                receipt = await bus.publish("orders.created", n)
                assert receipt.accepted == ("orders.*@audit", "orders.created@work")
            await bus.drain()
            assert sorted(audited) == list(range(200))
            assert sorted(worked["one"] + worked["two"]) == list(range(200))
            stats = bus.statistics()
            assert (
                stats.stage("orders.*@audit").acked,
                stats.stage("orders.created@work").acked,
            ) == (
                200,
                200,
            )
            ledger_exact(bus)
            assert await transport.backlog("orders.*", "audit") == 0


async def test_retries_dead_letters_and_replay_over_the_transport() -> None:
    transport = MemoryTransport(direct=False)
    bus = Bus(transport=transport)
    attempts: list[int] = []
    healed = False

    @bus.subscribe("jobs", group="g", retry=Retry(max_attempts=3, backoff=0.001, jitter=False))
    async def job(env: Envelope) -> None:
        attempts.append(env.attempt)
        if not healed:
            raise ValueError(f"job {env.payload} failed")

    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 7)
            await bus.drain()
            assert attempts == [1, 2, 3]
            [dead] = bus.dead_letters.list()
            assert (dead.reason, dead.stage, dead.attempts) == (
                DeadLetterReason.HANDLER_FAILED,
                "jobs@g",
                3,
            )
            stored = await transport.dead_letters()
            assert [entry.envelope.id for entry in stored] == [receipt.id]
            assert stored[0].reason == DeadLetterReason.HANDLER_FAILED
            # The transport's copy records the attempt that failed last, like the bus's.
            assert (stored[0].attempts, stored[0].envelope.attempt) == (3, 3)

            healed = True
            await bus.dead_letters.replay(receipt.id)
            await bus.drain()
            assert attempts == [1, 2, 3, 1]
            assert len(bus.dead_letters) == 0
            assert await transport.dead_letters() == []
            stats = bus.statistics().stage("jobs@g")
            assert (stats.published, stats.acked, stats.dead_lettered, stats.retried) == (
                2,
                1,
                1,
                2,
            )
            ledger_exact(bus)


async def test_dead_letters_kept_by_the_transport_come_back_with_a_new_bus() -> None:
    transport = MemoryTransport(direct=False)
    first = Bus(transport=transport)

    @first.subscribe("jobs", group="g")
    async def fail(n: int) -> None:
        raise RuntimeError("no")

    with anyio.fail_after(10):
        async with first:
            receipt = await first.publish("jobs", 1)
            await first.drain()
        second = Bus(transport=transport)
        async with second:
            [entry] = second.dead_letters.list()
            assert entry.envelope.id == receipt.id
            assert entry.reason == DeadLetterReason.HANDLER_FAILED
            assert second.dead_letters.purge() == 1
            await second.drain()
            assert await transport.dead_letters() == []


async def test_slips_and_requests_work_over_the_transport() -> None:
    bus = Bus(transport=MemoryTransport(direct=False))

    @bus.subscribe("double", group="d")
    async def double(n: int) -> int:
        return n * 2

    @bus.subscribe("increment", group="i")
    def increment(n: int) -> int:
        return n + 1

    @bus.subscribe("broken", group="b")
    async def broken(n: int) -> int:
        raise KeyError(n)

    with anyio.fail_after(10):
        async with bus:
            assert await bus.request("double", 20, slip=["increment"]) == 41
            with pytest.raises(HandlerError) as caught:
                await bus.request("broken", 3)
            assert caught.value.stage == "broken@b"
            await bus.drain()
            ledger_exact(bus)


async def test_shutdown_returns_unfinished_work_to_the_transport() -> None:
    transport = MemoryTransport(direct=False)
    release = anyio.Event()
    first = Bus(transport=transport)
    handled: list[Any] = []

    @first.subscribe("jobs", group="g", concurrency=2)
    async def stuck(n: int) -> None:
        await release.wait()

    with anyio.fail_after(10):
        async with first:
            for n in range(5):
                await first.publish("jobs", n)
            report = await first.aclose(timeout=0.1)
        assert report.drained is False
        assert report.published + 0 == report.completed + report.dead_lettered + len(
            report.abandoned
        )

        second = Bus(transport=transport)

        @second.subscribe("jobs", group="g")
        async def finish(n: int) -> None:
            handled.append(n)

        async with second:
            await second.drain()
        assert sorted(handled) == [0, 1, 2, 3, 4]


async def test_publish_many_is_one_routed_write_of_the_whole_batch() -> None:
    calls: list[tuple[str, int]] = []

    class Counting(MemoryTransport):
        async def publish_routed(self, topic: str, envelopes: Any) -> Any:
            calls.append((topic, len(envelopes)))
            return await super().publish_routed(topic, envelopes)

    bus = Bus(transport=Counting(direct=False))
    handled: list[int] = []

    @bus.subscribe("batch", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(10):
        async with bus:
            with capture(bus) as captured:
                receipts = await bus.publish_many("batch", range(50))
                nobody = await bus.publish_many("batch.nobody", [1, 2])
            await bus.drain()
    assert calls == [("batch", 50), ("batch.nobody", 2)]
    assert captured.payloads() == [*range(50), 1, 2]
    assert handled == list(range(50))
    assert [receipt.accepted for receipt in receipts] == [("batch@g",)] * 50
    assert [entry.envelope.id for entry in bus.dead_letters.list()] == [r.id for r in nobody]
    assert {entry.reason for entry in bus.dead_letters.list()} == {DeadLetterReason.NO_SUBSCRIBERS}
    ledger_exact(bus)
