"""Topics and patterns a broker cannot carry are refused at the bus's door, and the bus
goes on: each transport states its limits (``Transport.limits``), the bus checks a
pattern in ``subscribe`` (before start or while running) and a topic in ``publish``.

NATS closes the connection of a subject longer than its protocol line (4 KiB), RabbitMQ
keys hold 255 bytes; Redis keys take anything (16 KiB names are tried).
"""

from __future__ import annotations

import anyio
import pytest
from _brokers import make_transport

from asyncbus import Bus, ConfigurationError, Envelope
from asyncbus.transports import Transport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: Bytes of the names tried on a transport without a limit.
UNLIMITED = 16 * 1024


def _name(head: str, size: int) -> str:
    """``head`` then dot-separated tokens: a topic of exactly ``size`` bytes."""
    name = head
    while len(name) < size:
        name += "." + "t" * min(200, size - len(name) - 1)
    assert len(name.encode()) == size, (len(name), size)
    return name


def _handled(bus: Bus, pattern: str, into: list[tuple[str, object]], group: str = "g") -> None:
    async def handle(envelope: Envelope) -> None:
        into.append((envelope.topic, envelope.payload))

    bus.subscribe(pattern, handle, group=group)


async def test_the_longest_topic_is_carried_and_a_longer_one_refused_at_publish(
    kind: str, url: str, unique_prefix: str
) -> None:
    transport: Transport = make_transport(kind, url, unique_prefix)
    most = transport.limits.max_topic_bytes
    topic = _name("limits", most or UNLIMITED)
    bus = Bus(transport=transport)
    handled: list[tuple[str, object]] = []
    _handled(bus, "limits.>", handled)
    async with bus:
        with anyio.fail_after(30):
            await bus.publish(topic, 1)
            if most is not None:
                longer = _name("limits", most + 1)
                with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
                    await bus.publish(longer, 2)
                with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
                    await bus.publish_many(longer, [3, 4])
                # A routing slip's hop too: refused now, not dead-lettered once forwarded.
                with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
                    await bus.publish("limits.first", 6, slip=[longer])
            # The connection is whole: the bus publishes and consumes as before.
            await bus.publish("limits.after", 5)
            await bus.drain()
    assert handled == [(topic, 1), ("limits.after", 5)]
    (stage,) = bus.statistics().stages
    assert (stage.published, stage.acked, stage.dead_lettered) == (2, 2, 0)


async def test_a_pattern_the_broker_cannot_carry_is_refused_at_subscribe(
    kind: str, url: str, unique_prefix: str
) -> None:
    """Before start (both forms of ``subscribe``) and on the running bus, which goes on."""
    transport: Transport = make_transport(kind, url, unique_prefix)
    most = transport.limits.max_pattern_bytes
    pattern = _name("limits", most or UNLIMITED)  # the longest: carried
    bus = Bus(transport=transport)
    handled: list[tuple[str, object]] = []
    _handled(bus, pattern, handled)
    longer = _name("limits", most + 1) if most is not None else None
    if longer is not None:
        with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
            _handled(bus, longer, handled, group="h")
        with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
            bus.subscribe(longer, group="h")
    async with bus:
        with anyio.fail_after(30):
            if longer is not None:
                with pytest.raises(ConfigurationError, match=f"over the {most} bytes"):
                    _handled(bus, longer, handled, group="h")
            assert bus.running
            await bus.publish(pattern, 1)  # the pattern has no wildcard: it is a topic
            await bus.drain()
    assert handled == [(pattern, 1)]
    assert [stage.name for stage in bus.statistics().stages] == [f"{pattern}@g"]
