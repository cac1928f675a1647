"""The transport contract as the bus uses it: one bind per start, protocols looked up once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager

import pytest

from asyncbus import Bus, Envelope
from asyncbus.transports import (
    AcksWrittenBehind,
    BacklogReader,
    DeadLetterStore,
    Delivery,
    GroupPublisher,
    JsonCodec,
    KeepAlive,
    MemoryTransport,
    RoutedPublisher,
    Transport,
    TransportSettings,
)
from asyncbus.transports._bound import BoundTransport

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(10),
    pytest.mark.backends("asyncio", "uvloop", "trio"),
]


class Recording(MemoryTransport):
    """The in-process broker path, recording what the bus calls and sets."""

    def __init__(self) -> None:
        super().__init__(direct=False)
        self.calls: list[str] = []
        self.bound: list[TransportSettings] = []
        self.set_after_construction: list[str] = []
        self._constructed = True

    def __setattr__(self, name: str, value: object) -> None:
        if self.__dict__.get("_constructed") and not name.startswith("_"):
            self.set_after_construction.append(name)
        super().__setattr__(name, value)

    def bind(self, settings: TransportSettings) -> None:
        self.calls.append("bind")
        self.bound.append(settings)
        super().bind(settings)

    async def connect(self) -> None:
        self.calls.append("connect")
        await super().connect()


async def test_the_bus_binds_its_settings_once_per_start_before_entering() -> None:
    transport = Recording()
    codec = JsonCodec()
    bus = Bus(transport, dead_letter_ttl=60.0, dead_letter_maxlen=5, codec=codec)
    for _ in range(2):
        async with bus:
            pass
    assert transport.calls == ["bind", "connect", "bind", "connect"]
    assert transport.bound == [TransportSettings(60.0, 5, codec)] * 2
    assert transport.codec is codec
    # Everything came through bind (which sets ``settings`` and ``codec`` itself).
    assert set(transport.set_after_construction) <= {"settings", "codec", "close_deadline"}


async def test_a_bus_without_a_codec_leaves_the_transports_own() -> None:
    transport = Recording()
    own = transport.codec
    async with Bus(transport):
        pass
    assert transport.bound[0].codec is None
    assert transport.codec is own


class CoreOnly(Transport):
    """The core contract and nothing more."""

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        self.published = [*getattr(self, "published", []), (topic, list(envelopes))]

    def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[Delivery]]:
        raise NotImplementedError


async def test_optional_protocols_are_looked_up_once_with_the_bus_fallbacks() -> None:
    core = BoundTransport.of(CoreOnly())
    assert (core.routed, core.to_group, core.counter, core.store, core.acks) == (None,) * 5
    sent = Envelope(topic="a.b", payload=1)
    assert await core.publish_routed("a.b", [sent]) is None  # published; cannot tell
    await core.publish_to_group("a.*", "g", [sent])  # to the topic: every group
    assert core.transport.published == [("a.b", [sent]), ("a.b", [sent])]  # type: ignore[attr-defined]
    assert await core.backlog("a.*", "g") == 0
    assert await core.dead_letters() == []
    assert core.unsettled_acks() == []

    memory = MemoryTransport(direct=False)
    for protocol in (RoutedPublisher, GroupPublisher, BacklogReader, DeadLetterStore):
        assert isinstance(memory, protocol), protocol
    for protocol in (AcksWrittenBehind, KeepAlive):
        assert not isinstance(memory, protocol), protocol
    bound = BoundTransport.of(memory)
    assert bound.store is memory and bound.acks is None
