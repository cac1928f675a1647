"""A broker that stops answering: publishes end in bounded time.

A TCP proxy (``_proxy.TcpProxy``) stands between the bus and the shared broker and
black-holes the connections (the broker hears nothing, the bus gets no answer); the
broker itself is never touched. (Closing with the broker unreachable, refused or
black-holed, is in ``test_unreachable_at_close.py``.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import AsyncIterator

import anyio
import pytest
from _brokers import SHARED_PORTS, forget, make_transport, url_for  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Bus, TransportError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60), pytest.mark.chaos]

#: Seconds the transports here wait for a confirm, and a group's ack timeout.
PUBLISH_TIMEOUT = 1.5
ACK_TIMEOUT = 2.0
#: What a loaded machine may add to a deadline.
SLACK = 1.5


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
