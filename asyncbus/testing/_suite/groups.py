"""The suite's tests of a group's backlog, and of groups listed and deleted."""

from __future__ import annotations

import pytest

from ..._dead_letters import DeadLetterReason
from ...transports.base import BacklogReader, GroupAdmin, RoutedPublisher, Transport
from .base import SuiteBase
from .support import _check, _envelopes, _take


class GroupTests(SuiteBase):
    """A group's backlog; groups listed and deleted."""

    # -- backlog --------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_backlog_counts_what_the_group_has_not_settled(
        self, transport: Transport
    ) -> None:
        """``backlog`` counts a group's envelopes until they are acked or rejected."""
        if not isinstance(transport, BacklogReader):
            pytest.skip(f"{type(transport).__name__} is not a BacklogReader")
        sent = _envelopes("pending", 5)
        async with transport.subscribe("pending", group="g", prefetch=5) as deliveries:
            _check(await transport.backlog("pending", "g"), 0, "backlog of a new group")
            await transport.publish("pending", sent)
            _check(await transport.backlog("pending", "g"), 5, "backlog after publishing 5")
            taken = await _take(deliveries, 2, self.timeout, "two deliveries")
            await taken[0].ack()
            await taken[1].reject(DeadLetterReason.REJECTED.value)
            await self._backlog_becomes(transport, "pending", "g", 3)
            rest = await _take(deliveries, 3, self.timeout, "the other deliveries")
            for delivery in rest:
                await delivery.ack()
            await self._backlog_becomes(transport, "pending", "g", 0)
        _check(await transport.backlog("pending", "other"), 0, "backlog of an unknown group")

    # -- groups -----------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_groups_are_listed_and_a_deleted_one_gets_nothing_more(
        self, transport: Transport
    ) -> None:
        """:class:`~asyncbus.transports.GroupAdmin`: every group with its backlog, the one
        nobody reads with no consumer; a deleted group is gone, later publishes neither
        reach nor name it, and deleting it again says it was not there."""
        if not isinstance(transport, GroupAdmin):
            pytest.skip(f"{type(transport).__name__} is not a GroupAdmin")
        async with transport.subscribe("listed.*", group="kept", prefetch=5):
            async with transport.subscribe("listed.*", group="gone", prefetch=5):
                pass  # the group outlives its subscription
            await transport.publish("listed.one", _envelopes("listed.one", 2))
            listed = {(info.pattern, info.group): info for info in await transport.groups()}
            _check(sorted(listed), [("listed.*", "gone"), ("listed.*", "kept")], "groups")
            gone, kept = listed["listed.*", "gone"], listed["listed.*", "kept"]
            _check((gone.backlog, gone.consumers), (2, 0), "backlog and consumers of 'gone'")
            _check((kept.backlog, kept.local), (2, False), "backlog of 'kept', local")
            _check(await transport.delete_group("listed.*", "gone"), True, "first deletion")
            _check(await transport.delete_group("listed.*", "gone"), False, "second deletion")
            _check(
                [(info.group, info.backlog) for info in await transport.groups()],
                [("kept", 2)],
                "groups after the deletion",
            )
            if isinstance(transport, RoutedPublisher):
                reached = await transport.publish_routed("listed.two", _envelopes("listed.two", 1))
                if reached is not None:
                    _check(reached, ("listed.*@kept",), "groups a later publish reached")
            else:
                await transport.publish("listed.two", _envelopes("listed.two", 1))
            _check(
                [(info.group, info.backlog) for info in await transport.groups()],
                [("kept", 3)],
                "groups after a later publish",
            )
