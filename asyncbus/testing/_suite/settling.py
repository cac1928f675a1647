"""The suite's tests of settling a delivery: ack, nack (with a delay), once only,
and the dead letter a reject stores."""

from __future__ import annotations

import time

import anyio
import pytest

from ..._dead_letters import DeadLetterReason
from ..._envelope import Envelope
from ..._exceptions import TransportError
from ...transports.base import DeadLetterStore, Transport
from .base import SuiteBase
from .support import QUIET, _check, _check_envelope, _next


class SettlingTests(SuiteBase):
    """Settling: ack, nack, once only, reject."""

    # -- settling -------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_acked_envelope_is_not_delivered_again(self, transport: Transport) -> None:
        """After ``ack``, leaving and re-subscribing to the group delivers only new work."""
        first, marker = Envelope(topic="acked", payload=1), Envelope(topic="acked", payload=2)
        async with transport.subscribe("acked", group="g", prefetch=5) as deliveries:
            await transport.publish("acked", [first])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.ack()
        async with transport.subscribe("acked", group="g", prefetch=5) as deliveries:
            await transport.publish("acked", [marker])
            delivery = await _next(deliveries, self.timeout, "the second envelope")
            _check(delivery.envelope.id, marker.id, "id after re-subscribing")
            await delivery.ack()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"acked envelope came back: {extra.envelope!r}")

    @pytest.mark.anyio
    async def test_nack_redelivers_with_the_next_attempt(self, transport: Transport) -> None:
        """``nack()`` redelivers the same envelope, ``attempt`` counting deliveries."""
        sent = Envelope(topic="retry", payload={"x": "ÿ"}, headers={"k": "v"})
        async with transport.subscribe("retry", group="g", prefetch=1) as deliveries:
            await transport.publish("retry", [sent])
            for attempt in (1, 2, 3):
                delivery = await _next(deliveries, self.timeout, f"attempt {attempt}")
                _check_envelope(delivery.envelope, sent, attempt=attempt)
                if attempt < 3:
                    await delivery.nack()
            await delivery.ack()

    @pytest.mark.anyio
    async def test_nack_with_delay_redelivers_after_the_delay(self, transport: Transport) -> None:
        """``nack(delay=)`` redelivers no sooner than the delay (and not much later)."""
        self._require(transport, "delayed_nack")
        delay = 0.5
        sent = Envelope(topic="later", payload="p")
        async with transport.subscribe("later", group="g", prefetch=1) as deliveries:
            await transport.publish("later", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            started = anyio.current_time()
            await delivery.nack(delay=delay)
            again = await _next(
                deliveries, delay + self.delay_slack, f"redelivery after nack(delay={delay})"
            )
            elapsed = anyio.current_time() - started
            assert elapsed >= delay, f"redelivered after {elapsed:.3f} s, before the {delay} s"
            _check_envelope(again.envelope, sent, attempt=2)
            await again.ack()

    @pytest.mark.anyio
    async def test_delayed_nack_does_not_hold_up_other_envelopes(
        self, transport: Transport
    ) -> None:
        """While one envelope waits out its delay, the consumer gets the next ones."""
        self._require(transport, "delayed_nack")
        delayed, other = Envelope(topic="later", payload=1), Envelope(topic="later", payload=2)
        async with transport.subscribe("later", group="g", prefetch=1) as deliveries:
            await transport.publish("later", [delayed])
            delivery = await _next(deliveries, self.timeout, "the first envelope")
            started = anyio.current_time()
            await delivery.nack(delay=5.0)
            await transport.publish("later", [other])
            next_one = await _next(deliveries, self.timeout, "the second envelope")
            _check(next_one.envelope.id, other.id, "envelope delivered during the delay")
            assert anyio.current_time() - started < 5.0, "waited for the delayed envelope"
            await next_one.ack()

    @pytest.mark.anyio
    async def test_settling_twice_raises_transport_error(self, transport: Transport) -> None:
        """A delivery is settled exactly once: a second ack/nack/reject raises."""
        async with transport.subscribe("twice", group="g", prefetch=1) as deliveries:
            await transport.publish("twice", [Envelope(topic="twice", payload=1)])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.nack()
            with pytest.raises(TransportError):
                await delivery.reject(DeadLetterReason.REJECTED.value)

    @pytest.mark.anyio
    async def test_reject_stores_a_dead_letter(self, transport: Transport) -> None:
        """``reject`` keeps the envelope, reason, error, stage and attempts; no redelivery."""
        sent = Envelope(topic="poison", payload={"bad": True}, headers={"h": "é"})
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.nack()
            delivery = await _next(deliveries, self.timeout, "the nacked envelope")
            before = time.time()
            await delivery.reject(
                DeadLetterReason.HANDLER_FAILED.value,
                error="ValueError: boom",
                stage="poison@g",
            )
            after = time.time()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"rejected envelope came back: {extra.envelope!r}")
        if not isinstance(transport, DeadLetterStore):
            return
        entries = await transport.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        entry = entries[0]
        _check_envelope(entry.envelope, sent, attempt=None)
        _check(entry.reason, DeadLetterReason.HANDLER_FAILED, "reason")
        _check(entry.error, "ValueError: boom", "error")
        _check(entry.stage, "poison@g", "stage")
        _check(entry.attempts, 2, "attempts")
        assert before - 1.0 <= entry.dead_at <= after + 1.0, (
            f"dead_at {entry.dead_at} not within [{before}, {after}]"
        )

    @pytest.mark.anyio
    async def test_reject_with_only_a_reason(self, transport: Transport) -> None:
        """``reject(reason)`` without error or stage stores ``None`` for both."""
        store = self._store(transport)
        sent = Envelope(topic="poison", payload=[1, 2])
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.reject(DeadLetterReason.REJECTED.value)
        entries = await store.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        _check(entries[0].reason, DeadLetterReason.REJECTED, "reason")
        _check((entries[0].error, entries[0].stage), (None, None), "(error, stage)")
        _check(entries[0].attempts, 1, "attempts")
        _check(entries[0].envelope.payload, [1, 2], "payload")

    @pytest.mark.anyio
    async def test_reject_records_the_last_attempt_the_bus_ran(self, transport: Transport) -> None:
        """``reject(attempts=N)``: retries ran in the bus, the dead letter says N."""
        store = self._store(transport)
        sent = Envelope(topic="poison", payload="retried")
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.reject(
                DeadLetterReason.HANDLER_FAILED.value,
                error="ValueError: third time",
                stage="poison@g",
                attempts=3,
            )
        entries = await store.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        _check((entries[0].attempts, entries[0].envelope.attempt), (3, 3), "attempts")
        _check(entries[0].error, "ValueError: third time", "error")
