"""``bus.groups()`` and ``bus.delete_group()`` in memory, and over the in-process broker
(``MemoryTransport(direct=False)``, which keeps groups the way a broker does)."""

from __future__ import annotations

import logging

import anyio
import pytest

from asyncbus import (
    Bus,
    BusClosedError,
    ConfigurationError,
    GroupInfo,
    GroupListing,
    MemoryTransport,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_in_memory_the_groups_are_the_stages_of_the_bus() -> None:
    bus = Bus()
    release = anyio.Event()

    @bus.subscribe("orders.*", group="mailer", concurrency=2)
    async def mail(n: int) -> None:
        await release.wait()

    @bus.subscribe("audit", group="auditor")
    async def audit(n: int) -> None:
        pass

    with anyio.fail_after(10):
        async with bus:
            for n in range(5):
                await bus.publish("orders.created", n)
            listed = await bus.groups()
            assert listed == [
                GroupInfo("audit", "auditor", 0, 1, None, True),
                GroupInfo("orders.*", "mailer", 5, 2, None, True),
            ]
            assert listed[1].name == "orders.*@mailer"
            with pytest.raises(ConfigurationError, match="subscribed in this process"):
                await bus.delete_group("orders.*", "mailer")
            assert await bus.delete_group("orders.*", "nobody") is False
            release.set()


async def test_a_renamed_handlers_old_group_is_deleted_over_the_in_process_broker() -> None:
    transport = MemoryTransport(direct=False)
    old = Bus(transport=transport)

    @old.subscribe("orders.*", group="old")
    async def gone(n: int) -> None:
        raise AssertionError("the old group's bus is closed")

    with anyio.fail_after(10):
        async with old:
            await old.subscribed()
        bus = Bus(transport=transport)
        handled: list[int] = []

        @bus.subscribe("orders.*", group="new")
        async def handle(n: int) -> None:
            handled.append(n)

        async with bus:
            await bus.subscribed()
            receipts = [await bus.publish("orders.created", n) for n in range(3)]
            assert {receipt.accepted for receipt in receipts} == {("orders.*@new", "orders.*@old")}
            await bus.drain(timeout=5)
            assert [
                (info.name, info.backlog, info.consumers, info.local) for info in await bus.groups()
            ] == [("orders.*@new", 0, 1, True), ("orders.*@old", 3, 0, False)]
            with pytest.raises(ConfigurationError):
                await bus.delete_group("orders.*", "new")
            assert await bus.delete_group("orders.*", "old") is True
            assert await bus.delete_group("orders.*", "old") is False
            assert (await bus.publish("orders.created", 3)).accepted == ("orders.*@new",)
            await bus.drain(timeout=5)
            assert handled == [0, 1, 2, 3]
            assert [info.name for info in await bus.groups()] == ["orders.*@new"]


async def test_in_memory_groups_called_plainly_is_the_same_exact_list() -> None:
    bus = Bus()
    release = anyio.Event()

    @bus.subscribe("orders.*", group="mailer", concurrency=2)
    async def mail(n: int) -> None:
        await release.wait()

    assert bus.groups() == [GroupInfo("orders.*", "mailer", 0, 2, None, True)]
    with anyio.fail_after(10):
        async with bus:
            for n in range(5):
                await bus.publish("orders.created", n)
            listed = bus.groups()
            assert isinstance(listed, GroupListing)
            assert listed == [GroupInfo("orders.*", "mailer", 5, 2, None, True)]
            assert [(info.name, info.backlog) for info in listed] == [("orders.*@mailer", 5)]
            fresh = await listed
            assert isinstance(fresh, GroupListing)
            assert fresh == listed
            release.set()
            await bus.drain(timeout=5)
            assert bus.groups() == [GroupInfo("orders.*", "mailer", 0, 2, None, True)]
            assert await bus.groups() == bus.groups()


async def test_over_the_in_process_broker_groups_called_plainly_is_the_latest_reading() -> None:
    transport = MemoryTransport(direct=False)
    old = Bus(transport=transport)

    @old.subscribe("orders.*", group="old")
    async def gone(n: int) -> None:
        raise AssertionError("the old group's bus is closed")

    with anyio.fail_after(10):
        async with old:
            await old.subscribed()
        bus = Bus(transport=transport)

        @bus.subscribe("orders.*", group="new")
        async def handle(n: int) -> None:
            pass

        async with bus:
            await bus.subscribed()
            # Read at the start: both groups, the old one from the broker.
            assert [(info.name, info.local) for info in bus.groups()] == [
                ("orders.*@new", True),
                ("orders.*@old", False),
            ]
            for n in range(3):
                await bus.publish("orders.created", n)
            await bus.drain(timeout=5)
            assert [(info.name, info.backlog) for info in await bus.groups()] == [
                ("orders.*@new", 0),
                ("orders.*@old", 3),
            ]
            # The awaited reading is the plain call's latest one.
            assert [(info.name, info.backlog) for info in bus.groups()] == [
                ("orders.*@new", 0),
                ("orders.*@old", 3),
            ]

            @bus.subscribe("audit", group="auditor")
            async def audit(n: int) -> None:
                pass

            await bus.subscribed()
            # A stage subscribed since the last reading is listed with its figures here.
            assert [(info.name, info.local) for info in bus.groups()] == [
                ("audit@auditor", True),
                ("orders.*@new", True),
                ("orders.*@old", False),
            ]
            assert await bus.delete_group("orders.*", "old") is True
            assert "orders.*@old" not in [info.name for info in bus.groups()]


async def test_over_a_broker_groups_need_the_bus_running() -> None:
    bus = Bus(transport=MemoryTransport(direct=False))
    with pytest.raises(BusClosedError):
        bus.groups()
    with pytest.raises(BusClosedError):
        await bus.groups()
    with pytest.raises(BusClosedError):
        await bus.delete_group("orders.*", "old")


def test_a_group_is_stale_once_every_reading_for_the_threshold_found_no_consumer() -> None:
    from asyncbus._modes.stale_groups import StaleGroups

    watch = StaleGroups(MemoryTransport(direct=False), 60.0, {"mine@here"})
    read = GroupInfo("orders.*", "read", 0, 1, 0.0)
    quiet = GroupInfo("orders.*", "quiet", 5, 0, 0.0)  # its last activity is long gone
    mine = GroupInfo("mine", "here", 5, 0, None)
    watch.update([read, quiet, mine], 1000.0)
    assert watch.stale == {}  # (only this watcher's readings count)
    watch.update([read, quiet, mine], 1030.0)
    assert watch.stale == {}
    watch.update([read, quiet, mine], 1060.0)
    assert watch.stale == {"orders.*@quiet": 1000.0}
    # A reading with a consumer: no longer stale, and the count starts again.
    watch.update([read, GroupInfo("orders.*", "quiet", 5, 1, None)], 1070.0)
    assert watch.stale == {}
    watch.update([read, quiet], 1100.0)
    watch.update([read, quiet], 1159.0)
    assert watch.stale == {}
    watch.update([read, quiet], 1160.0)
    assert watch.stale == {"orders.*@quiet": 1100.0}


def test_a_stale_group_is_warned_of_once_per_threshold(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from asyncbus._modes.stale_groups import StaleGroups

    watch = StaleGroups(MemoryTransport(direct=False), 60.0, ())
    watch.update([GroupInfo("orders.*", "old", 5, 0, 0.0)], 100.0)
    watch.update([GroupInfo("orders.*", "old", 5, 0, 0.0)], 160.0)
    with caplog.at_level(logging.WARNING, logger="asyncbus.groups"):
        watch.reached("orders.created", ("orders.*@new", "orders.*@old"))
        watch.reached("orders.created", ("orders.*@old",))
    (record,) = caplog.records
    assert (record.stage, record.topic) == ("orders.*@old", "orders.created")  # type: ignore[attr-defined]


def test_stale_group_after_is_checked() -> None:
    for wrong in (0, -1.0, float("nan"), float("inf"), "1"):
        with pytest.raises(ConfigurationError, match="stale_group_after"):
            Bus(stale_group_after=wrong)  # type: ignore[arg-type]
