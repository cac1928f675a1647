"""MemoryTransport against the conformance suite (asyncio, uvloop, trio), and its own rules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from asyncbus import ConfigurationError
from asyncbus._envelope import Envelope
from asyncbus._exceptions import TransportError
from asyncbus.testing.transport_suite import QUIET, TransportSuite
from asyncbus.transports import MemoryTransport, Transport

# In memory: every backend, as the core's tests.
pytestmark = pytest.mark.backends("asyncio", "uvloop", "trio")


class TestMemory(TransportSuite):
    """The reference transport passes the suite it defines."""

    @pytest.fixture
    async def transport(self) -> AsyncIterator[Transport]:
        """A fresh, entered MemoryTransport (nothing is shared between tests)."""
        async with MemoryTransport() as transport:
            yield transport


@pytest.mark.anyio
async def test_publish_before_any_subscription_reaches_no_group() -> None:
    """Groups exist from their first subscribe on; earlier envelopes go nowhere."""
    async with MemoryTransport() as transport:
        await transport.publish("early", [Envelope(topic="early", payload=1)])
        async with transport.subscribe("early", group="g", prefetch=1) as deliveries:
            with anyio.move_on_after(QUIET):
                delivery = await anext(deliveries)
                raise AssertionError(f"got {delivery.envelope!r} published before the group")


@pytest.mark.anyio
async def test_group_outlives_its_subscription() -> None:
    """Envelopes published while no consumer is subscribed wait for the next one."""
    sent = Envelope(topic="durable", payload=1)
    async with MemoryTransport() as transport:
        async with transport.subscribe("durable", group="g", prefetch=1):
            pass
        await transport.publish("durable", [sent])
        assert await transport.backlog("durable", "g") == 1
        async with transport.subscribe("durable", group="g", prefetch=1) as deliveries:
            with anyio.fail_after(5):
                delivery = await anext(deliveries)
            assert delivery.envelope.id == sent.id
            await delivery.ack()


@pytest.mark.anyio
async def test_released_delivery_cannot_be_settled_afterwards() -> None:
    """A delivery handed back by leaving the subscription is no longer the consumer's."""
    async with MemoryTransport() as transport:
        async with transport.subscribe("t", group="g", prefetch=1) as deliveries:
            await transport.publish("t", [Envelope(topic="t", payload=1)])
            with anyio.fail_after(5):
                delivery = await anext(deliveries)
        with pytest.raises(TransportError):
            await delivery.ack()


@pytest.mark.anyio
async def test_delayed_nack_needs_an_entered_transport() -> None:
    """``nack(delay=)`` runs in the transport's task group, so it must be entered."""
    transport = MemoryTransport()
    async with transport.subscribe("t", group="g", prefetch=1) as deliveries:
        await transport.publish("t", [Envelope(topic="t", payload=1)])
        with anyio.fail_after(5):
            delivery = await anext(deliveries)
        with pytest.raises(TransportError, match="entered"):
            await delivery.nack(delay=1.0)


@pytest.mark.anyio
async def test_aclose_cancels_pending_delayed_redeliveries() -> None:
    """Closing the transport does not wait for envelopes sleeping out a nack delay."""
    transport = MemoryTransport()
    with anyio.fail_after(5):
        async with transport, transport.subscribe("t", group="g", prefetch=1) as deliveries:
            await transport.publish("t", [Envelope(topic="t", payload=1)])
            delivery = await anext(deliveries)
            await delivery.nack(delay=3600)


@pytest.mark.anyio
async def test_prefetch_below_one_is_refused() -> None:
    """A consumer that may hold nothing could never receive anything."""
    async with MemoryTransport() as transport:
        with pytest.raises(ValueError, match="prefetch"):
            async with transport.subscribe("t", group="g", prefetch=0):
                pass


@pytest.mark.anyio
async def test_publish_refuses_a_wildcard_topic() -> None:
    """Wildcards belong in patterns; publishing to one is a configuration error."""
    async with MemoryTransport() as transport:
        with pytest.raises(ConfigurationError):
            await transport.publish("a.*", [Envelope(topic="a.*", payload=1)])
