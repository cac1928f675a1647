"""Long handlers and long retry delays are not run twice by default, on every broker.

Two buses share one group (two processes of a service). A handler that takes longer
than the transport's ``ack_timeout``, or a retry that waits longer, keeps its
delivery: it is handled once (twice, for the retry), never again by the other bus or
by its own. ``keep_alive`` is on by default; on RabbitMQ it means no client-side ack
timeout (the broker gives a delivery to another consumer only when its connection
drops).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from _brokers import make_transport, names, url_for  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, Retry
from asyncbus.testing.transport_suite import QUIET
from asyncbus.transports import Transport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

ACK_TIMEOUT = 1.0
#: Longer than ack_timeout, with a margin: 3 ack timeouts.
LONG = 3 * ACK_TIMEOUT


async def _two_processes(
    make: Callable[[], Transport], *, handler_sleeps: float, retry: Retry | None
) -> list[tuple[str, int]]:
    """Two buses in group ``g``; one envelope; who handled which attempt."""
    handled: list[tuple[str, int]] = []
    buses = {name: Bus(transport=make()) for name in ("one", "two")}
    for name, bus in buses.items():

        def subscribe(bus: Bus, name: str) -> None:
            @bus.subscribe("long", group="g", retry=retry)
            async def handle(envelope: Envelope) -> None:
                handled.append((name, envelope.attempt))
                await anyio.sleep(handler_sleeps)
                if retry is not None and envelope.attempt == 1:
                    raise RuntimeError("once")

        subscribe(bus, name)
    with anyio.fail_after(60):
        async with buses["one"], buses["two"]:
            await buses["one"].publish("long", "work")
            for bus in buses.values():
                await bus.drain()
            await anyio.sleep(QUIET)  # nothing comes back afterwards
            for bus in buses.values():
                await bus.drain()
            stages = [bus.statistics().stage("long@g") for bus in buses.values()]
    assert sum(stage.acked for stage in stages) == 1
    assert sum(stage.dead_lettered for stage in stages) == 0
    return handled


def _attempts(handled: list[tuple[str, int]]) -> list[int]:
    assert len({name for name, _ in handled}) == 1, f"handled by both buses: {handled}"
    return [attempt for _, attempt in handled]


@pytest.fixture(params=names())
def make(request: pytest.FixtureRequest) -> Callable[[], Transport]:
    """A factory of transports of one broker, on a prefix of the test's own."""
    kind: str = request.param
    url = request.getfixturevalue(f"{kind}_url")
    prefix = request.getfixturevalue(f"{kind}_prefix")
    return lambda: make_transport(kind, url, prefix, ack_timeout=ACK_TIMEOUT)  # type: ignore[no-any-return]


async def test_a_handler_longer_than_ack_timeout_runs_once(make: Callable[[], Transport]) -> None:
    handled = await _two_processes(make, handler_sleeps=LONG, retry=None)
    assert _attempts(handled) == [1]


async def test_a_retry_delay_longer_than_ack_timeout_does_not_redeliver(
    make: Callable[[], Transport],
) -> None:
    retry = Retry(max_attempts=2, backoff=LONG, jitter=False)
    handled = await _two_processes(make, handler_sleeps=0.0, retry=retry)
    assert _attempts(handled) == [1, 2]


@pytest.mark.parametrize("kind", names())
def test_keep_alive_is_on_and_max_deliveries_is_ten_by_default(kind: str) -> None:
    transport = make_transport(kind, url_for(kind, 1), "p", ack_timeout=ACK_TIMEOUT)
    assert (transport.keep_alive, transport.max_deliveries) == (True, 10)


@pytest.mark.parametrize("kind", names())
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "10"])
def test_max_deliveries_must_be_a_positive_int(kind: str, bad: Any) -> None:
    from asyncbus import ConfigurationError

    with pytest.raises(ConfigurationError, match="max_deliveries"):
        make_transport(kind, url_for(kind, 1), "p", max_deliveries=bad)
