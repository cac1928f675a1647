"""Closing while the broker is unreachable: the report is exact and comes in time.

Each broker is a private server of this module (``_private_brokers``) behind a TCP
proxy of each test (``_proxy``) that refuses connections (the broker is down) or
black-holes them (it accepts bytes and never answers). What the bus handled while the
broker could not hear it was never settled there: ``aclose`` lists exactly those
envelopes in ``ShutdownReport.abandoned`` (and no other), returns within its timeout,
and the broker delivers exactly them again once it is reachable.
"""

from __future__ import annotations

import time
from collections import Counter

import anyio
import pytest
from _brokers import make_transport, url_for  # type: ignore[import-not-found]
from _private_brokers import PrivateServer  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.chaos, pytest.mark.timeout(120)]

#: Seconds the transports here wait for the broker, and their ack timeout.
PUBLISH_TIMEOUT = 1.5
ACK_TIMEOUT = 2.0
#: What scheduling may add to an ``aclose`` deadline (no round trip fits in it).
MARGIN = 0.2
#: Acked before the fault, and handled while the broker cannot hear.
BEFORE, DURING = 40, 16


def _bus(kind: str, url: str, prefix: str) -> Bus:
    transport = make_transport(
        kind, url, prefix, publish_timeout=PUBLISH_TIMEOUT, ack_timeout=ACK_TIMEOUT
    )
    return Bus(transport=transport)


async def _handled_again(kind: str, url: str, prefix: str, expected: list[str]) -> list[str]:
    """What a second bus of the group gets from the broker, once it is reachable."""
    again: list[str] = []
    done = anyio.Event()
    survivor = _bus(kind, url, prefix)

    @survivor.subscribe("jobs", group="workers", concurrency=DURING, capacity=DURING)
    async def redo(envelope: Envelope) -> None:
        again.append(envelope.id)
        if Counter(again) >= Counter(expected):
            done.set()

    with anyio.fail_after(30):
        async with survivor:
            await done.wait()
            await survivor.drain(10)
    return again


@pytest.mark.parametrize("fault", ["refuse", "blackhole"])
async def test_what_was_handled_while_the_broker_could_not_hear_is_exactly_what_is_abandoned(
    private_server: tuple[str, PrivateServer], fault: str, unique_prefix: str
) -> None:
    kind, broker = private_server
    before = [f"before-{n}" for n in range(BEFORE)]
    during = [f"during-{n}" for n in range(DURING)]
    holding = anyio.Event()
    gate = anyio.Event()
    held: list[str] = []
    handled: list[str] = []
    with TcpProxy(broker.port) as proxy:
        bus = _bus(kind, url_for(kind, proxy.port), unique_prefix)

        @bus.subscribe("jobs", group="workers", concurrency=DURING, capacity=DURING)
        async def work(envelope: Envelope) -> None:
            if envelope.id.startswith("during"):
                held.append(envelope.id)
                if len(held) == DURING:
                    holding.set()
                await gate.wait()  # finishes once the broker cannot hear its ack
            handled.append(envelope.id)

        with anyio.fail_after(60):
            async with bus:
                for envelope_id in before:
                    await bus.publish("jobs", envelope_id, id=envelope_id)
                await bus.drain()  # handled, and settled in the broker
                for envelope_id in during:
                    await bus.publish("jobs", envelope_id, id=envelope_id)
                await holding.wait()
                getattr(proxy, fault)()
                gate.set()
                began = time.monotonic()
                report = await bus.aclose(3.0)
                took = time.monotonic() - began
        assert Counter(handled) == Counter(before + during)
        assert took <= 3.0 + MARGIN, f"aclose(3.0) took {took:.2f} s"
        assert (report.published, report.completed, report.dead_lettered) == (
            BEFORE + DURING,
            BEFORE,
            0,
        )
        assert sorted(report.abandoned) == sorted(during)
        proxy.forward()  # (cuts what was black-holed: the broker sees it gone)
    assert Counter(await _handled_again(kind, broker.url, unique_prefix, during)) == Counter(during)


@pytest.mark.parametrize("fault", ["refuse", "blackhole"])
async def test_aclose_returns_within_its_timeout_however_the_broker_is_gone(
    private_server: tuple[str, PrivateServer], fault: str, unique_prefix: str
) -> None:
    kind, broker = private_server
    ids = [f"job-{n}" for n in range(6)]
    started = anyio.Event()
    with TcpProxy(broker.port) as proxy:
        bus = _bus(kind, url_for(kind, proxy.port), unique_prefix)

        @bus.subscribe("jobs", group="workers", concurrency=2, capacity=4)
        async def stuck(envelope: Envelope) -> None:
            started.set()
            await anyio.sleep_forever()  # in flight when the bus closes

        with anyio.fail_after(60):
            async with bus:
                for envelope_id in ids:
                    await bus.publish("jobs", envelope_id, id=envelope_id)
                await started.wait()
                getattr(proxy, fault)()
                began = time.monotonic()
                report = await bus.aclose(2.0)
                closed_in = time.monotonic() - began
            exited_in = time.monotonic() - began
        assert closed_in <= 2.0 + MARGIN, f"aclose(2.0) took {closed_in:.2f} s"
        assert exited_in <= 2.0 + MARGIN, f"leaving `async with` took {exited_in:.2f} s"
        assert (report.drained, report.completed, report.dead_lettered) == (False, 0, 0)
        assert set(report.abandoned) <= set(ids) and len(report.abandoned) == report.published
        proxy.forward()
    assert Counter(await _handled_again(kind, broker.url, unique_prefix, ids)) == Counter(ids)
