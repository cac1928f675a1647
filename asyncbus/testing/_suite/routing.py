"""The suite's tests of routing (patterns, one group, order for one consumer) and
of the longest names a broker carries."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

from ..._envelope import Envelope
from ..._exceptions import ConfigurationError
from ...transports.base import GroupPublisher, Transport
from .base import SuiteBase
from .support import QUIET, _check, _check_envelope, _envelopes, _ids, _Inbox, _name_of, _next


class RoutingTests(SuiteBase):
    """Routing, order for one consumer, and the names a broker carries."""

    # -- routing --------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_patterns_route_by_token(self, transport: Transport) -> None:
        """``*`` matches exactly one token, ``>`` one or more; exact patterns match one topic."""
        topics = ["shop", "shop.orders", "shop.users", "shop.orders.created", "other.orders"]
        groups = {
            "exact": ("shop.orders", {"shop.orders"}),
            "star": ("shop.*", {"shop.orders", "shop.users"}),
            "tail": ("shop.>", {"shop.orders", "shop.users", "shop.orders.created"}),
            "middle": ("*.orders", {"shop.orders", "other.orders"}),
            "all": (">", set(topics)),
        }
        inbox = _Inbox()
        async with AsyncExitStack() as stack:
            subscriptions = {
                group: await stack.enter_async_context(
                    transport.subscribe(pattern, group=group, prefetch=10)
                )
                for group, (pattern, _) in groups.items()
            }
            async with anyio.create_task_group() as tg:
                for group, deliveries in subscriptions.items():
                    tg.start_soon(inbox.consume, deliveries, group)
                for topic in topics:
                    await transport.publish(topic, [Envelope(topic=topic, payload=topic)])
                for group, (_, expected) in groups.items():
                    await inbox.wait_for(len(expected), self.timeout, group)
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        for group, (pattern, expected) in groups.items():
            got = sorted(d.envelope.topic for d in inbox.of(group))
            _check(got, sorted(expected), f"topics delivered to {pattern!r}")

    @pytest.mark.anyio
    async def test_publish_to_group_reaches_only_that_group(self, transport: Transport) -> None:
        """``publish_to_group`` (replay) delivers to the named group and no other."""
        if not isinstance(transport, GroupPublisher):
            pytest.skip(f"{type(transport).__name__} is not a GroupPublisher")
        sent = Envelope(topic="replayed.one", payload="again", headers={"asyncbus-replayed": "1"})
        inbox = _Inbox()
        async with (
            transport.subscribe("replayed.*", group="target", prefetch=5) as target,
            transport.subscribe("replayed.*", group="bystander", prefetch=5) as bystander,
            transport.subscribe("replayed.one", group="target", prefetch=5) as other_pattern,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, target, "target")
            tg.start_soon(inbox.consume, bystander, "bystander")
            tg.start_soon(inbox.consume, other_pattern, "other_pattern")
            await transport.publish_to_group("replayed.*", "target", [sent])
            await inbox.wait_for(1, self.timeout, "target")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(_ids(inbox.of("target")), [sent.id], "ids to the target group")
        _check_envelope(inbox.of("target")[0].envelope, sent)
        _check(inbox.count("bystander"), 0, "deliveries to another group")
        _check(inbox.count("other_pattern"), 0, "deliveries to the group on another pattern")

    @pytest.mark.anyio
    async def test_one_consumer_sees_one_topic_in_publish_order(self, transport: Transport) -> None:
        """Where ``capabilities.ordered``: publish order is delivery order for one consumer."""
        self._require(transport, "ordered")
        sent = _envelopes("ordered", 30)
        inbox = _Inbox()
        async with (
            transport.subscribe("ordered", group="g", prefetch=7) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("ordered", sent[:10])
            for envelope in sent[10:20]:
                await transport.publish("ordered", [envelope])
            await transport.publish("ordered", sent[20:])
            await inbox.wait_for(len(sent), self.timeout)
            tg.cancel_scope.cancel()
        _check(_ids(inbox.of("c")), _ids(sent), "ids in delivery order")

    # -- names the broker can carry ----------------------------------------------------

    @pytest.mark.anyio
    async def test_names_at_the_limits_are_carried_and_longer_ones_refused(
        self, transport: Transport
    ) -> None:
        """The longest pattern and topic :attr:`Transport.limits` allow work end to end
        (16 KiB where there is no limit); one byte more is a :class:`ConfigurationError`
        before anything reaches the broker, and the transport goes on as before."""
        limits = transport.limits
        most = limits.max_pattern_bytes or self.unlimited_name_bytes
        name = _name_of(most)
        assert len(name.encode()) <= (limits.max_topic_bytes or most), "topic over its limit"
        sent = Envelope(topic=name, payload="long")
        async with transport.subscribe(name, group="g", prefetch=1) as deliveries:
            await transport.publish(name, [sent])
            delivery = await _next(deliveries, self.timeout, "the envelope on the longest name")
            _check(delivery.envelope.topic, name, "topic")
            await delivery.ack()
            refused: list[tuple[str, Callable[[], Any]]] = []
            if limits.max_topic_bytes is not None:
                longer = _name_of(limits.max_topic_bytes + 1)
                refused.append(("topic", functools.partial(transport.check_topic, longer)))
                refused.append(
                    ("publish", functools.partial(transport.publish, longer, [sent.evolve()]))
                )
            if limits.max_pattern_bytes is not None:
                longer = _name_of(limits.max_pattern_bytes + 1)
                refused.append(("pattern", functools.partial(transport.check_pattern, longer)))
            for what, call in refused:
                with pytest.raises(ConfigurationError):
                    outcome = call()
                    if hasattr(outcome, "__await__"):
                        await outcome
                    raise AssertionError(f"{what} one byte over the limit was taken")
            after = Envelope(topic=name, payload="after")
            await transport.publish(name, [after])
            delivery = await _next(deliveries, self.timeout, "an envelope after the refusals")
            _check_envelope(delivery.envelope, after)
            await delivery.ack()
