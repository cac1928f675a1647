"""The suite's tests of bodies and headers: a large payload, unicode headers, a
body that does not decode."""

from __future__ import annotations

import string

import pytest

from ..._dead_letters import DeadLetterReason
from ..._envelope import Envelope
from ...transports.base import DeadLetterStore, Transport
from .base import SuiteBase
from .support import _check, _check_envelope, _next


class BodyTests(SuiteBase):
    """Bodies and headers."""

    # -- bodies and headers ---------------------------------------------------------

    @pytest.mark.anyio
    async def test_large_payload_arrives_whole(self, transport: Transport) -> None:
        """A 1 MiB string payload survives the trip."""
        size = self.large_payload_size
        alphabet = string.ascii_letters + string.digits
        payload = (alphabet * (size // len(alphabet) + 1))[:size]
        sent = Envelope(topic="large", payload=payload)
        async with transport.subscribe("large", group="g", prefetch=1) as deliveries:
            await transport.publish("large", [sent])
            delivery = await _next(deliveries, self.timeout, "the large envelope")
            _check(len(delivery.envelope.payload), size, "payload length")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_headers_keep_unicode_values(self, transport: Transport) -> None:
        """Header values with non-ASCII text, spaces, quotes, and empty ones arrive intact."""
        headers = {
            "greeting": "grüß dich, 世界 🌍",
            "empty": "",
            "spaced": "  a  b  ",
            "quoted": "\"quoted\" 'single' \\ back",
            "json-like": '{"a": [1, 2]}',
            "long": "x" * 2000,
        }
        sent = Envelope(topic="headers", payload=None, headers=headers)
        async with transport.subscribe("headers", group="g", prefetch=1) as deliveries:
            await transport.publish("headers", [sent])
            delivery = await _next(deliveries, self.timeout, "the envelope with headers")
            _check(dict(delivery.envelope.headers), headers, "headers")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_undecodable_body_is_delivered_with_an_error(self, transport: Transport) -> None:
        """A body the codec cannot read arrives with ``error`` set and the raw bytes."""
        if type(self).publish_raw is SuiteBase.publish_raw:
            pytest.skip(f"{type(self).__name__} does not implement publish_raw")
        body = b"\xff\xfe not a valid body {"
        async with transport.subscribe("raw.*", group="g", prefetch=1) as deliveries:
            await self.publish_raw(transport, "raw.bytes", body)
            delivery = await _next(deliveries, self.timeout, "the undecodable envelope")
            assert isinstance(delivery.error, str), f"delivery.error is {delivery.error!r}"
            assert delivery.error, "delivery.error is empty"
            _check(delivery.envelope.payload, body, "payload of an undecodable body")
            _check(delivery.envelope.topic, "raw.bytes", "topic")
            await delivery.reject(DeadLetterReason.REJECTED.value, error=delivery.error)
        if isinstance(transport, DeadLetterStore):
            entries = await transport.dead_letters()
            _check(len(entries), 1, "dead letters after rejecting it")
            _check(entries[0].envelope.payload, body, "dead letter payload")
