"""A broker that stops answering or goes away: publishes and closes end in bounded time.

A TCP proxy (``_proxy.TcpProxy``) stands between the bus and the shared broker and
black-holes the connections (the broker hears nothing, the bus gets no answer) or
refuses them (the broker is down); the broker itself is never touched.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest
from _kinds import SHARED_PORTS, forget, make_transport, url_for  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, TransportError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: Seconds the transports here wait for a confirm, and a group's ack timeout.
PUBLISH_TIMEOUT = 1.5
ACK_TIMEOUT = 2.0
#: What a loaded machine may add to a deadline.
SLACK = 1.5


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the broker clients are asyncio libraries


@pytest.fixture
async def proxy(kind: str, unique_prefix: str) -> AsyncIterator[TcpProxy]:
    with TcpProxy(SHARED_PORTS[kind]) as running:
        yield running
    with anyio.CancelScope(shield=True):
        await forget(kind, url_for(kind, SHARED_PORTS[kind]), unique_prefix)


def through(kind: str, proxy: TcpProxy, prefix: str) -> Bus:
    transport = make_transport(
        kind,
        url_for(kind, proxy.port),
        prefix,
        publish_timeout=PUBLISH_TIMEOUT,
        ack_timeout=ACK_TIMEOUT,
    )
    return Bus(transport=transport)


@pytest.mark.parametrize("call", ["publish", "publish_many"])
async def test_a_publish_to_a_silent_broker_raises_transport_error_at_publish_timeout(
    kind: str, proxy: TcpProxy, unique_prefix: str, call: str
) -> None:
    bus = through(kind, proxy, unique_prefix)
    handled: list[int] = []

    @bus.subscribe("jobs", group="workers")
    async def work(number: int) -> None:
        handled.append(number)

    async def send(numbers: range) -> None:
        if call == "publish":
            for number in numbers:
                await bus.publish("jobs", number)
        else:
            await bus.publish_many("jobs", numbers)

    cut_off = range(100, 101) if call == "publish" else range(100, 300)
    async with bus:
        await send(range(10))
        await bus.drain(20)  # handled and acked before the silence
        proxy.blackhole()
        started = time.monotonic()
        with pytest.raises(TransportError, match="publish"), anyio.fail_after(30):
            await send(cut_off)
        elapsed = time.monotonic() - started
        # One deadline for the call, however many envelopes it carries.
        assert PUBLISH_TIMEOUT - 0.1 <= elapsed <= PUBLISH_TIMEOUT + SLACK
        proxy.forward()
        # Healed: the transport reconnects and publishes again.
        with anyio.fail_after(30):
            while True:
                try:
                    await send(range(1000, 1001))
                    break
                except TransportError:
                    await anyio.sleep(0.1)
        await send(range(1001, 1010))
        await bus.drain(20)
    # Before and after the silence, each once; of what was cut off, what the broker got
    # before the silence may have been stored and handled (at-least-once), nothing else.
    assert Counter(n for n in handled if n < 100 or n >= 1000) == Counter(
        [*range(10), *range(1000, 1010)]
    )
    assert {n for n in handled if 100 <= n < 1000} <= set(cut_off)


@pytest.mark.parametrize("fault", ["refuse", "blackhole"])
async def test_closing_with_the_broker_unreachable_reports_in_time_and_the_broker_redelivers(
    kind: str, proxy: TcpProxy, unique_prefix: str, fault: str
) -> None:
    ids = [f"job{n}" for n in range(6)]
    bus = through(kind, proxy, unique_prefix)
    started = anyio.Event()
    running = 0

    @bus.subscribe("jobs", group="workers", concurrency=2, capacity=4)
    async def stuck(envelope: Envelope) -> None:
        nonlocal running
        running += 1
        if running == 2:
            started.set()
        await anyio.sleep_forever()  # in flight when the bus closes

    timeout = 2.0
    with anyio.fail_after(40):
        async with bus:
            for envelope_id in ids:
                await bus.publish("jobs", envelope_id, id=envelope_id)
            await started.wait()
            getattr(proxy, fault)()
            began = time.monotonic()
            report = await bus.aclose(timeout=timeout)
            closed_in = time.monotonic() - began
        exited_in = time.monotonic() - began

    assert closed_in <= timeout + SLACK, f"aclose took {closed_in:.2f} s"
    assert exited_in <= timeout + SLACK, f"leaving `async with` took {exited_in:.2f} s"
    assert report.drained is False
    assert report.completed == 0 and report.dead_lettered == 0
    assert report.published == len(report.abandoned) >= 2
    assert set(report.abandoned) <= set(ids)

    # The broker is back: a second bus of the group gets every envelope, the abandoned
    # ones included, each once.
    proxy.forward()
    handled: list[str] = []
    done = anyio.Event()
    survivor = Bus(
        transport=make_transport(
            kind, url_for(kind, SHARED_PORTS[kind]), unique_prefix, ack_timeout=ACK_TIMEOUT
        )
    )

    @survivor.subscribe("jobs", group="workers", concurrency=2, capacity=4)
    async def work(envelope: Envelope) -> None:
        handled.append(envelope.id)
        if set(handled) >= set(ids):
            done.set()

    with anyio.fail_after(30):
        async with survivor:
            await done.wait()
            await survivor.drain(10)
    assert Counter(handled) == Counter(ids)


@pytest.mark.parametrize("kind", ["redis", "rabbit"])  # (their acks are written behind)
async def test_acks_the_broker_never_got_are_reported_abandoned_and_come_back(
    kind: str, proxy: TcpProxy, unique_prefix: str
) -> None:
    ids = [f"job{n}" for n in range(4)]
    bus = through(kind, proxy, unique_prefix)
    gate = anyio.Event()
    holding = anyio.Event()
    handled: list[str] = []

    @bus.subscribe("jobs", group="workers", concurrency=4, capacity=4)
    async def work(envelope: Envelope) -> None:
        handled.append(envelope.id)
        if len(handled) == len(ids):
            holding.set()
        await gate.wait()

    with anyio.fail_after(40):
        async with bus:
            for envelope_id in ids:
                await bus.publish("jobs", envelope_id, id=envelope_id)
            await holding.wait()
            proxy.refuse()  # the broker goes away while the handlers finish
            gate.set()
            report = await bus.aclose(timeout=2.0)
    assert sorted(handled) == ids
    # Handled, but their acks never reached the broker: listed, and not completed.
    assert (report.completed, report.dead_lettered) == (0, 0)
    assert sorted(report.abandoned) == ids

    proxy.forward()
    again: list[str] = []
    done = anyio.Event()
    survivor = Bus(
        transport=make_transport(
            kind, url_for(kind, SHARED_PORTS[kind]), unique_prefix, ack_timeout=ACK_TIMEOUT
        )
    )

    @survivor.subscribe("jobs", group="workers", concurrency=4, capacity=4)
    async def redo(envelope: Envelope) -> None:
        again.append(envelope.id)
        if len(again) == len(ids):
            done.set()

    with anyio.fail_after(30):
        async with survivor:
            await done.wait()
            await survivor.drain(10)
    assert sorted(again) == ids
