"""The suite's tests of consumers that leave, are cancelled, hang or die: who gets
what they held."""

from __future__ import annotations

import functools

import anyio
import pytest

from ..._envelope import Envelope
from ...transports.base import KeepAlive, Transport
from .base import SuiteBase
from .support import (
    QUIET,
    REDELIVERY_GRACE,
    _check,
    _check_envelope,
    _envelopes,
    _Holder,
    _ids,
    _Inbox,
    _keep_alive,
    _take,
    _wait,
)


class ConsumerTests(SuiteBase):
    """Consumers that leave or die: who gets what they held."""

    # -- consumers that leave or die ----------------------------------------------

    @pytest.mark.anyio
    async def test_consumer_that_leaves_releases_its_unsettled_deliveries(
        self, transport: Transport
    ) -> None:
        """Leaving ``subscribe`` without settling hands the deliveries to another consumer.

        Promptly (:attr:`release_timeout`), not after an ack timeout. The attempt is
        not asserted exactly: the reference keeps it (no handler saw the envelope),
        a broker may count the delivery.
        """
        sent = _envelopes("leave", 3)
        inbox = _Inbox()
        async with transport.subscribe("leave", group="g", prefetch=3) as leaving:
            await transport.publish("leave", sent)
            taken = await _take(leaving, 3, self.timeout, "deliveries before leaving")
        async with (
            transport.subscribe("leave", group="g", prefetch=3) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(taken)), "ids released")
        for delivery in inbox.of("survivor"):
            sent_one = next(e for e in sent if e.id == delivery.envelope.id)
            _check_envelope(delivery.envelope, sent_one, attempt=None)
            assert delivery.envelope.attempt in (1, 2), f"attempt {delivery.envelope.attempt}"

    @pytest.mark.anyio
    async def test_consumer_cancelled_while_waiting_releases_what_it_holds(
        self, transport: Transport
    ) -> None:
        """The bus's shutdown: the pump is cancelled mid-wait holding unsettled deliveries."""
        sent = _envelopes("cancelled", 3)
        held = _Inbox()
        async with (
            transport.subscribe("cancelled", group="g", prefetch=5) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(held.consume, ack=False), deliveries, "held")
            await transport.publish("cancelled", sent)
            await held.wait_for(len(sent), self.timeout)
            tg.cancel_scope.cancel()
        inbox = _Inbox()
        async with (
            transport.subscribe("cancelled", group="g", prefetch=5) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_leaving_under_cancellation_still_releases(self, transport: Transport) -> None:
        """Clean-up is shielded: a subscription left by a cancelled task still hands back."""
        sent = _envelopes("shielded", 2)
        with anyio.CancelScope() as scope:
            async with transport.subscribe("shielded", group="g", prefetch=2) as deliveries:
                await transport.publish("shielded", sent)
                await _take(deliveries, len(sent), self.timeout, "deliveries before leaving")
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught, "the cancelled scope did not end the subscription"
        inbox = _Inbox()
        async with (
            transport.subscribe("shielded", group="g", prefetch=2) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_consumer_that_leaves_while_another_waits_wakes_it(
        self, transport: Transport
    ) -> None:
        """A consumer already waiting for work gets the deliveries another one releases."""
        sent = _envelopes("leave", 2)
        inbox = _Inbox()
        holder = _Holder(transport, "leave", group="g", prefetch=2)
        async with anyio.create_task_group() as outer:
            outer.start_soon(holder.run, len(sent), self.timeout)
            await _wait(holder.subscribed, self.timeout, "the first consumer to subscribe")
            await transport.publish("leave", sent)
            await _wait(holder.took, self.timeout, "the first consumer to take its deliveries")
            async with (
                transport.subscribe("leave", group="g", prefetch=2) as waiting,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, waiting, "waiting")
                await anyio.sleep(QUIET)
                _check(inbox.count(), 0, "deliveries while the first consumer holds them")
                holder.leave.set()
                await inbox.wait_for(len(sent), self.release_timeout, "waiting")
                tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("waiting"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_deliveries_of_a_dead_consumer_go_to_another_after_ack_timeout(
        self, transport: Transport
    ) -> None:
        """A consumer that stops settling (hung, or killed) loses its deliveries.

        Within ``ack_timeout`` + ``REDELIVERY_GRACE`` another consumer of the group gets
        them, as the next attempt; when the dead consumer finally leaves, nothing comes
        twice.
        (A transport that keeps held deliveries alive, ``keep_alive``, is tested with
        it off: with it on, only a dead process loses them.)
        """
        if self.ack_timeout is None:
            pytest.skip(f"{type(transport).__name__} has no ack timeout")
        with _keep_alive(transport, False):
            await self._check_hung_consumer_loses_its_delivery(transport)

    async def _check_hung_consumer_loses_its_delivery(self, transport: Transport) -> None:
        assert self.ack_timeout is not None
        sent = Envelope(topic="crash", payload="work")
        inbox = _Inbox()
        dead = _Holder(transport, "crash", group="g", prefetch=1)
        async with anyio.create_task_group() as outer:
            outer.start_soon(dead.run, 1, self.timeout)
            await _wait(dead.subscribed, self.timeout, "the consumer that dies to subscribe")
            await transport.publish("crash", [sent])
            await _wait(dead.took, self.timeout, "a delivery to the consumer that dies")
            async with (
                transport.subscribe("crash", group="g", prefetch=1) as survivor,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, survivor, "survivor")
                await inbox.wait_for(1, self.ack_timeout + REDELIVERY_GRACE, "survivor")
                # A redelivery, not the first delivery: attempt 2 normally; on a loaded
                # machine the broker may have redelivered once more before the
                # survivor's pull took it, so only "more than one" is a contract.
                got = inbox.of("survivor")[0].envelope
                _check_envelope(got, sent, attempt=None)
                assert got.attempt >= 2, f"envelope.attempt of {sent.id}: {got.attempt}"
                dead.leave.set()
                await _wait(dead.left, self.timeout, "the dead consumer to leave")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        _check(inbox.count(), 1, "deliveries to the survivor (after the dead one left)")

    @pytest.mark.anyio
    async def test_a_live_consumer_keeps_what_it_holds_past_ack_timeout(
        self, transport: Transport
    ) -> None:
        """With ``keep_alive`` (the default where a transport has it), a delivery held
        longer than ``ack_timeout`` by a live consumer (a long handler, a retry
        waiting) goes to nobody else; when that consumer leaves, another gets it once.
        """
        if self.ack_timeout is None:
            pytest.skip(f"{type(transport).__name__} has no ack timeout")
        if not (isinstance(transport, KeepAlive) and transport.keep_alive):
            pytest.skip(f"{type(transport).__name__} does not keep held deliveries alive")
        sent = Envelope(topic="long", payload="work")
        inbox = _Inbox()
        holder = _Holder(transport, "long", group="g", prefetch=1)
        async with anyio.create_task_group() as outer:
            outer.start_soon(holder.run, 1, self.timeout)
            await _wait(holder.subscribed, self.timeout, "the holding consumer to subscribe")
            await transport.publish("long", [sent])
            await _wait(holder.took, self.timeout, "a delivery to the holding consumer")
            async with (
                transport.subscribe("long", group="g", prefetch=1) as other,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, other, "other")
                await anyio.sleep(self.ack_timeout * 2.5)
                _check(inbox.count(), 0, "deliveries to another consumer while it is held")
                holder.leave.set()
                await _wait(holder.left, self.timeout, "the holding consumer to leave")
                await inbox.wait_for(1, self.release_timeout + self.ack_timeout, "other")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        _check(inbox.count(), 1, "deliveries to the other consumer")
        _check(_ids(inbox.of("other")), [sent.id], "the id it got")
