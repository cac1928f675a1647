"""The suite's tests of publish and subscribe: fields kept, routed publishes,
batches, fan-out, competing consumers and prefetch."""

from __future__ import annotations

import functools

import anyio
import pytest

from ..._dead_letters import DeadLetterReason
from ..._envelope import Envelope
from ...transports.base import (
    BaseDelivery,
    DeadLetterStore,
    RoutedPublisher,
    SubscriptionControl,
    Transport,
)
from .base import SuiteBase
from .support import QUIET, _check, _check_envelope, _envelopes, _ids, _Inbox, _next


class PublishTests(SuiteBase):
    """Publish and subscribe: fields, batches, groups, consumers, prefetch."""

    # -- publish and subscribe ----------------------------------------------------

    @pytest.mark.anyio
    async def test_publish_subscribe_round_trip_preserves_every_field(
        self, transport: Transport
    ) -> None:
        """Payload, headers, timing and correlation fields arrive as they were sent."""
        sent = Envelope(
            topic="orders.created",
            payload={"n": 1, "name": "Zoë", "items": [1, 2.5, None, True, "ü"], "empty": {}},
            headers={"tenant": "acme", "trace": "00-abc-01"},
            ttl=3600.0,
            slip=("orders.billed", "orders.shipped"),
            correlation_id="correlation-1",
            causation_id="cause-1",
            reply_to="replies.one",
            sender="transport-suite",
        )
        async with transport.subscribe("orders.created", group="g", prefetch=10) as deliveries:
            await transport.publish("orders.created", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            _check(delivery.error, None, "delivery.error")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_publish_routed_names_the_groups_reached_or_dead_letters(
        self, transport: Transport
    ) -> None:
        """``publish_routed`` names the groups it reached (sorted); with none, it publishes
        nothing and keeps a ``no_subscribers`` dead letter. (A transport that cannot
        tell returns ``None`` and is not held to it.)"""
        if not isinstance(transport, RoutedPublisher):
            pytest.skip(f"{type(transport).__name__} is not a RoutedPublisher")
        lost = Envelope(topic="routed.nobody", payload="lost")
        reached = await transport.publish_routed("routed.nobody", [lost])
        if reached is None:
            pytest.skip(f"{type(transport).__name__} cannot tell which groups it reached")
        _check(reached, (), "groups reached by a topic nobody subscribes to")
        if isinstance(transport, DeadLetterStore):
            listed = [e for e in await transport.dead_letters() if e.envelope.id == lost.id]
            _check(len(listed), 1, "dead letters of the unrouted envelope")
            _check(listed[0].reason, DeadLetterReason.NO_SUBSCRIBERS, "its reason")
            _check(listed[0].envelope.payload, "lost", "its payload")
        sent = Envelope(topic="routed.items", payload="found")
        async with (
            transport.subscribe("routed.*", group="b", prefetch=1) as second,
            transport.subscribe("routed.items", group="a", prefetch=1) as first,
        ):
            reached = await transport.publish_routed("routed.items", [sent])
            _check(reached, ("routed.*@b", "routed.items@a"), "groups reached")
            for deliveries in (first, second):
                delivery = await _next(deliveries, self.timeout, "the routed envelope")
                _check_envelope(delivery.envelope, sent)
                await delivery.ack()

    @pytest.mark.anyio
    async def test_correlation_id_defaults_to_the_envelope_id(self, transport: Transport) -> None:
        """An envelope without explicit correlation keeps its own id as correlation id."""
        sent = Envelope(topic="plain", payload="text")
        async with transport.subscribe("plain", group="g", prefetch=1) as deliveries:
            await transport.publish("plain", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            _check_envelope(delivery.envelope, sent)
            _check(delivery.envelope.correlation_id, sent.id, "correlation_id")
            await delivery.ack()

    @pytest.mark.anyio
    async def test_publish_of_a_batch_delivers_each_envelope_once(
        self, transport: Transport
    ) -> None:
        """One publish call with many envelopes delivers each of them exactly once."""
        sent = _envelopes("batch", 25)
        inbox = _Inbox()
        async with (
            transport.subscribe("batch", group="g", prefetch=10) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("batch", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("c"))), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_a_batch_of_deliveries_held_at_once_settles_in_any_order(
        self, transport: Transport
    ) -> None:
        """What a batch consumer does: hold ``prefetch`` deliveries, then settle them last
        first, most acked and some rejected; each is settled once and none comes back."""
        sent = _envelopes("held", 12)
        async with transport.subscribe("held", group="g", prefetch=len(sent)) as deliveries:
            await transport.publish("held", sent)
            held = [
                await _next(deliveries, self.timeout, f"delivery {n + 1} of {len(sent)}")
                for n in range(len(sent))
            ]
            _check(sorted(_ids(held)), sorted(_ids(sent)), "ids held at once")
            rejected = []
            for position, delivery in reversed(list(enumerate(held))):
                if position % 4 == 1:
                    rejected.append(delivery.envelope.id)
                    await delivery.reject(DeadLetterReason.REJECTED.value, stage="held@g")
                else:
                    await delivery.ack()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"a settled envelope came back: {extra.envelope!r}")
        if isinstance(transport, DeadLetterStore):
            entries = await transport.dead_letters()
            _check(sorted(_ids(entry.envelope for entry in entries)), sorted(rejected), "dead")

    @pytest.mark.anyio
    async def test_publish_of_200_envelopes_reaches_one_consumer_once_each_in_order(
        self, transport: Transport
    ) -> None:
        """A batch as ``Bus.publish_many`` writes it (one ``publish`` call): each envelope
        exactly once, and in publish order for one consumer where ``capabilities.ordered``.
        """
        sent = _envelopes("bulk", 200)
        inbox = _Inbox()
        async with (
            transport.subscribe("bulk", group="g", prefetch=50) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("bulk", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)  # a duplicate would arrive meanwhile
            tg.cancel_scope.cancel()
        got = _ids(inbox.of("c"))
        if transport.capabilities.ordered:
            _check(got, _ids(sent), "ids in delivery order")
        else:
            _check(sorted(got), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_fan_out_gives_every_group_every_envelope(self, transport: Transport) -> None:
        """Two groups on one pattern each receive all envelopes, exactly once."""
        sent = _envelopes("events.fan", 10)
        inbox = _Inbox()
        async with (
            transport.subscribe("events.fan", group="one", prefetch=5) as first,
            transport.subscribe("events.fan", group="two", prefetch=5) as second,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, first, "one")
            tg.start_soon(inbox.consume, second, "two")
            for envelope in sent:
                await transport.publish("events.fan", [envelope])
            await inbox.wait_for(len(sent), self.timeout, "one")
            await inbox.wait_for(len(sent), self.timeout, "two")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        for group in ("one", "two"):
            _check(sorted(_ids(inbox.of(group))), sorted(_ids(sent)), f"ids to group {group}")

    @pytest.mark.anyio
    async def test_second_publish_of_an_envelope_id_is_dropped(self, transport: Transport) -> None:
        """Where ``capabilities.dedup``: the broker keeps one envelope per id."""
        self._require(transport, "dedup")
        sent, marker = Envelope(topic="dedup", payload=1), Envelope(topic="dedup", payload=2)
        inbox = _Inbox()
        async with (
            transport.subscribe("dedup", group="g", prefetch=5) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("dedup", [sent])
            await transport.publish("dedup", [sent, marker])
            await inbox.wait_until(
                lambda: marker.id in _ids(inbox.of("c")), self.timeout, "the marker envelope"
            )
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("c"))), sorted([sent.id, marker.id]), "ids delivered")

    @pytest.mark.anyio
    async def test_competing_consumers_split_the_envelopes_of_a_group(
        self, transport: Transport
    ) -> None:
        """Two consumers of one group: each envelope goes to exactly one of them."""
        sent = _envelopes("work", 40)
        inbox = _Inbox()
        async with (
            transport.subscribe("work", group="workers", prefetch=4) as first,
            transport.subscribe("work", group="workers", prefetch=4) as second,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, first, "first")
            tg.start_soon(inbox.consume, second, "second")
            await transport.publish("work", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        first_ids, second_ids = _ids(inbox.of("first")), _ids(inbox.of("second"))
        _check(len(first_ids) + len(second_ids), len(sent), "deliveries in all")
        _check(set(first_ids) & set(second_ids), set(), "ids delivered to both consumers")
        _check(sorted(first_ids + second_ids), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_consumer_at_its_prefetch_leaves_the_rest_to_another(
        self, transport: Transport
    ) -> None:
        """A consumer holding ``prefetch`` unsettled deliveries gets no more; a peer does."""
        sent = _envelopes("work", 4)
        async with transport.subscribe("work", group="workers", prefetch=1) as busy:
            await transport.publish("work", sent)
            held = await _next(busy, self.timeout, "a first delivery to the busy consumer")
            inbox = _Inbox()
            async with (
                transport.subscribe("work", group="workers", prefetch=10) as idle,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, idle, "idle")
                await inbox.wait_for(len(sent) - 1, self.timeout, "idle")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
            await held.ack()
        got = _ids(inbox.of("idle"))
        _check(sorted([held.envelope.id, *got]), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_prefetch_bounds_the_unsettled_deliveries(self, transport: Transport) -> None:
        """No more than ``prefetch`` deliveries are unsettled at once; settling makes room."""
        prefetch = 3
        sent = _envelopes("bounded", 8)
        inbox = _Inbox()
        async with (
            transport.subscribe("bounded", group="g", prefetch=prefetch) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(inbox.consume, ack=False), deliveries, "c")
            await transport.publish("bounded", sent)
            await inbox.wait_for(prefetch, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch, "unsettled deliveries with a full prefetch")
            await inbox.items[0][1].ack()
            await inbox.wait_for(prefetch + 1, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch + 1, "deliveries after settling one")
            await inbox.items[1][1].nack()
            await inbox.items[2][1].reject(DeadLetterReason.REJECTED.value)
            await inbox.wait_for(prefetch + 3, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch + 3, "deliveries after settling three")
            for _, delivery in inbox.items[3:]:
                await delivery.ack()
            await inbox.wait_for(len(sent) + 1, self.timeout)  # + 1: the nacked one again
            tg.cancel_scope.cancel()
        _check(sorted(set(_ids(d for _, d in inbox.items))), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_set_prefetch_gives_back_uncounted_what_it_received_beyond(
        self, transport: Transport
    ) -> None:
        """A :class:`SubscriptionControl` subscription brought down to one while it holds
        one delivery handed out gives back what it received beyond: a peer gets those, not
        as redeliveries; the one handed out stays."""
        async with transport.subscribe("resize", group="g", prefetch=4) as probe:
            steered = isinstance(probe, SubscriptionControl)
        if not steered:
            pytest.skip(f"{type(transport).__name__}'s subscriptions keep their prefetch")
        sent = _envelopes("resize", 4)
        inbox = _Inbox()
        async with transport.subscribe("resize", group="g", prefetch=4) as first:
            assert isinstance(first, SubscriptionControl)
            await transport.publish("resize", sent)
            held = await _next(first, self.timeout, "a first delivery")
            await first.set_prefetch(1)
            async with (
                transport.subscribe("resize", group="g", prefetch=4) as peer,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, peer, "peer")
                await inbox.wait_for(len(sent) - 1, self.timeout, "peer")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
            await held.ack()
            await first.flush()
        got = inbox.of("peer")
        _check(sorted([held.envelope.id, *_ids(got)]), sorted(_ids(sent)), "ids delivered")
        _check(
            [d.redeliveries for d in got if isinstance(d, BaseDelivery)],
            [0] * (len(sent) - 1),
            "redeliveries of what was given back",
        )
