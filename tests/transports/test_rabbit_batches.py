"""RabbitTransport publishing many envelopes in one call: pipelined, confirms gathered.

``publish(topic, envelopes)`` and ``publish_routed`` with a list (what
``Bus.publish_many`` calls, once for the whole list) send every message before awaiting
any confirm, then await the confirms together, and return only once the broker
confirmed them all. Against the real RabbitMQ (127.0.0.1:5672), on asyncio only.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from _brokers import SHARED_PORTS, url_for  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import DeadLetterReason, Envelope, TransportError
from asyncbus.testing.transport_suite import QUIET
from asyncbus.transports.base import Delivery
from asyncbus.transports.rabbit import RabbitTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

COUNT = 200
#: Seconds a publish waits for its confirms in the silent-broker test.
PUBLISH_TIMEOUT = 1.5
#: What a loaded machine may add to a deadline.
SLACK = 1.5


@pytest.fixture
async def prefix(rabbit_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``; everything declared under it is deleted afterwards."""
    yield unique_prefix
    with anyio.CancelScope(shield=True):
        await RabbitTransport(rabbit_url, prefix=unique_prefix).delete_everything()


def _envelopes(topic: str, count: int = COUNT) -> list[Envelope]:
    return [Envelope(topic=topic, payload={"n": n}) for n in range(count)]


async def _take(deliveries: AsyncIterator[Delivery], count: int) -> list[Delivery]:
    """The next ``count`` deliveries, each acked."""
    taken: list[Delivery] = []
    with anyio.fail_after(30):
        while len(taken) < count:
            delivery = await anext(deliveries)
            await delivery.ack()
            taken.append(delivery)
    return taken


def _record_acks(
    deliveries: AsyncIterator[Delivery],
    written: list[tuple[int, bool]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Record ``(delivery tag, multiple)`` of every ack written on the subscription's
    channel from now on."""
    channel = deliveries.consumer.channel  # type: ignore[attr-defined]
    original = channel.basic_ack

    async def recorded(delivery_tag: int, multiple: bool = False, **options: Any) -> Any:
        written.append((delivery_tag, multiple))
        return await original(delivery_tag, multiple=multiple, **options)

    monkeypatch.setattr(channel, "basic_ack", recorded)


async def _nothing_within(deliveries: AsyncIterator[Delivery], seconds: float = QUIET) -> None:
    with anyio.move_on_after(seconds):
        extra = await anext(deliveries)
        pytest.fail(f"unexpected delivery {extra.envelope!r}")


async def test_one_publish_of_200_envelopes_delivers_each_once_in_order(
    rabbit_url: str, prefix: str
) -> None:
    envelopes = _envelopes("many")
    async with (
        RabbitTransport(rabbit_url, prefix=prefix) as transport,
        transport.subscribe("many", group="g", prefetch=50) as deliveries,
    ):
        await transport.publish("many", envelopes)
        received = await _take(deliveries, COUNT)
        await _nothing_within(deliveries)
        assert [d.envelope.id for d in received] == [e.id for e in envelopes]
        assert [d.envelope.payload for d in received] == [{"n": n} for n in range(COUNT)]
        assert {d.envelope.attempt for d in received} == {1}
        assert await transport.backlog("many", "g") == 0


async def test_one_routed_publish_of_200_envelopes_names_the_group_and_delivers_each_once(
    rabbit_url: str, prefix: str
) -> None:
    envelopes = _envelopes("routed")
    async with (
        RabbitTransport(rabbit_url, prefix=prefix) as transport,
        transport.subscribe("routed", group="g", prefetch=50) as deliveries,
    ):
        reached = await transport.publish_routed("routed", envelopes)
        assert reached == ("routed@g",)
        received = await _take(deliveries, COUNT)
        await _nothing_within(deliveries)
        assert [d.envelope.id for d in received] == [e.id for e in envelopes]
        assert await transport.dead_letters() == []


async def test_one_routed_publish_nobody_takes_stores_every_envelope_as_a_dead_letter(
    rabbit_url: str, prefix: str
) -> None:
    envelopes = _envelopes("nobody", 50)
    async with RabbitTransport(rabbit_url, prefix=prefix) as transport:
        assert await transport.publish_routed("nobody", envelopes) == ()
        dead = await transport.dead_letters()
    assert [entry.envelope.id for entry in dead] == [e.id for e in envelopes]
    assert {entry.reason for entry in dead} == {DeadLetterReason.NO_SUBSCRIBERS}


async def test_one_publish_sends_every_envelope_before_awaiting_any_confirm(
    rabbit_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Instrumented channel: each publish waits until all 200 were started, so a
    transport awaiting one confirm before sending the next could never finish."""
    async with (
        RabbitTransport(rabbit_url, prefix=prefix, publish_timeout=10) as transport,
        transport.subscribe("gated", group="g", prefetch=50) as deliveries,
    ):
        link = transport._links.link
        assert link is not None
        channel = link.channel
        original = channel.basic_publish
        started: list[bytes] = []
        all_started = anyio.Event()

        async def gated(body: bytes, **options: Any) -> Any:
            started.append(body)
            if len(started) == COUNT:
                all_started.set()
            await all_started.wait()
            return await original(body, **options)

        monkeypatch.setattr(channel, "basic_publish", gated)
        envelopes = _envelopes("gated")
        with anyio.fail_after(15):
            await transport.publish("gated", envelopes)
        monkeypatch.undo()
        assert len(started) == COUNT
        received = await _take(deliveries, COUNT)
        await _nothing_within(deliveries)
        assert sorted(d.envelope.id for d in received) == sorted(e.id for e in envelopes)


async def test_one_publish_to_a_silent_broker_raises_transport_error_at_publish_timeout(
    prefix: str,
) -> None:
    with TcpProxy(SHARED_PORTS["rabbit"]) as proxy:
        transport = RabbitTransport(
            url_for("rabbit", proxy.port), prefix=prefix, publish_timeout=PUBLISH_TIMEOUT
        )
        async with transport:
            await transport.publish("silent", _envelopes("silent", 10))
            proxy.blackhole()
            started = time.monotonic()
            with pytest.raises(TransportError, match="publish"), anyio.fail_after(30):
                await transport.publish("silent", _envelopes("silent"))
            elapsed = time.monotonic() - started
            assert PUBLISH_TIMEOUT - 0.1 <= elapsed <= PUBLISH_TIMEOUT + SLACK
            proxy.forward()


async def test_consecutive_acks_go_out_as_multiple_acks_covering_every_tag_once(
    rabbit_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    envelopes = _envelopes("acks")
    written: list[tuple[int, bool]] = []
    async with RabbitTransport(rabbit_url, prefix=prefix) as transport:
        async with transport.subscribe("acks", group="g", prefetch=COUNT) as deliveries:
            await transport.publish("acks", envelopes)
            first = await _take(deliveries, 1)
            _record_acks(deliveries, written, monkeypatch)
            rest = await _take(deliveries, COUNT - 1)
            assert [d.envelope.id for d in first + rest] == [e.id for e in envelopes]
        # Leaving wrote what was still queued.
        assert await transport.backlog("acks", "g") == 0
    # Every ack was a multiple one; together they cover tags 1..200, each exactly once
    # (the first may have gone out before the recording began).
    assert {multiple for _tag, multiple in written} == {True}
    tags = [tag for tag, _multiple in written]
    assert tags == sorted(tags) and tags[-1] == COUNT
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(("prefetch", "count", "per_write"), [(1, 5, 1), (4, 12, 2)])
async def test_acks_go_out_at_half_the_prefetch_without_waiting_for_the_linger(
    rabbit_url: str,
    prefix: str,
    monkeypatch: pytest.MonkeyPatch,
    prefetch: int,
    count: int,
    per_write: int,
) -> None:
    # An hour's linger: a consumer that had to wait for it would never get past its
    # prefetch, so every delivery arriving proves the acks went out in batches of half
    # the prefetch (at once for a prefetch of 1).
    monkeypatch.setattr("asyncbus.transports.rabbit._ACK_LINGER", 3600.0)
    envelopes = _envelopes("half", count)
    written: list[tuple[int, bool]] = []
    async with (
        RabbitTransport(rabbit_url, prefix=prefix) as transport,
        transport.subscribe("half", group="g", prefetch=prefetch) as deliveries,
    ):
        await transport.publish("half", envelopes)
        with anyio.fail_after(30):
            first = await anext(deliveries)
        _record_acks(deliveries, written, monkeypatch)
        await first.ack()
        rest = await _take(deliveries, count - 1)
        assert [d.envelope.id for d in [first, *rest]] == [e.id for e in envelopes]
        await _nothing_within(deliveries)
    # Multiple acks, each tag covered once; every write but the last (made as the
    # subscription ended) covered at least half the prefetch.
    tags = [tag for tag, _multiple in written]
    assert {multiple for _tag, multiple in written} == {True}
    assert tags == sorted(set(tags)) and tags[-1] == count
    covered = [tag - before for before, tag in itertools.pairwise([0, *tags])]
    assert all(step >= per_write for step in covered[:-1]), covered
    if prefetch == 1:
        assert tags == list(range(1, count + 1))  # each written at once
