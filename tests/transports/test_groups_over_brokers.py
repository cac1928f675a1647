"""Groups over every broker: listed with their backlog and consumers, deleted with it.

The case the feature is for: a handler renamed (a new group) leaves its old group bound
in the broker, named by every publish and holding every envelope. Listing shows it;
deleting it (and only it: this process's own groups are refused) stops both, in this
process and in a process that only learns of the deletion from the broker.
"""

from __future__ import annotations

import logging

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, GroupInfo
from asyncbus.transports import GroupAdmin

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def _figures(groups: list[GroupInfo]) -> list[tuple[str, str, int, bool]]:
    return [(info.pattern, info.group, info.backlog, info.local) for info in groups]


async def _bind_old_group(kind: str, url: str, prefix: str) -> None:
    """A process that subscribed group ``old`` and left (the handler was renamed since)."""
    old = Bus(transport=make_transport(kind, url, prefix))

    @old.subscribe("orders.*", group="old")
    async def handle(n: int) -> None:
        raise AssertionError("the old group's process is gone")

    async with old:
        await old.subscribed()


async def test_a_renamed_handlers_old_group_is_listed_then_deleted_with_its_backlog(
    kind: str, url: str, unique_prefix: str
) -> None:
    await _bind_old_group(kind, url, unique_prefix)
    transport = make_transport(kind, url, unique_prefix)
    bus = Bus(transport=transport)
    handled: list[int] = []

    @bus.subscribe("orders.*", group="new")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(60):
        async with bus:
            await bus.subscribed()
            receipts = [await bus.publish("orders.created", n) for n in range(3)]
            assert [receipt.accepted for receipt in receipts] == [
                ("orders.*@new", "orders.*@old")
            ] * 3
            await bus.drain(timeout=30)
            assert sorted(handled) == [0, 1, 2]
            listed = await bus.groups()
            assert _figures(listed) == [
                ("orders.*", "new", 0, True),
                ("orders.*", "old", 3, False),
            ]
            assert [info.name for info in listed] == ["orders.*@new", "orders.*@old"]
            assert listed[1].consumers == 0
            # Called plainly: the latest reading, which the awaited call just took.
            assert _figures(bus.groups()) == _figures(listed)

            with pytest.raises(ConfigurationError, match="subscribed in this process"):
                await bus.delete_group("orders.*", "new")
            assert await bus.delete_group("orders.*", "old") is True
            assert await bus.delete_group("orders.*", "old") is False
            assert [info.name for info in bus.groups()] == ["orders.*@new"]

            receipt = await bus.publish("orders.created", 3)
            assert receipt.accepted == ("orders.*@new",)
            await bus.drain(timeout=30)
            assert sorted(handled) == [0, 1, 2, 3]
            assert _figures(await bus.groups()) == [("orders.*", "new", 0, True)]
            assert isinstance(transport, GroupAdmin)
            assert await transport.backlog("orders.*", "old") == 0  # type: ignore[attr-defined]


async def test_a_group_deleted_by_another_process_is_no_longer_reached_by_a_publisher(
    kind: str, url: str, unique_prefix: str
) -> None:
    await _bind_old_group(kind, url, unique_prefix)
    with anyio.fail_after(60):
        async with Bus(transport=make_transport(kind, url, unique_prefix)) as publisher:
            # The publisher knows the group (its routes are made, and kept).
            first = await publisher.publish("orders.created", 1)
            assert first.accepted == ("orders.*@old",)
            async with Bus(transport=make_transport(kind, url, unique_prefix)) as console:
                # Read when the console started: the old group, and the one envelope in it.
                assert _figures(console.groups()) == [("orders.*", "old", 1, False)]
                assert _figures(await console.groups()) == [("orders.*", "old", 1, False)]
                assert await console.delete_group("orders.*", "old") is True
                assert await console.groups() == []
            if kind == "nats":
                # NATS tells other processes by an advisory; wait for it to arrive.
                await _advisory_seen(publisher)
            second = await publisher.publish("orders.created", 2)
            # No group left anywhere: a no_subscribers dead letter, not a silent loss.
            assert second.accepted == ()
            assert [entry.envelope.id for entry in publisher.dead_letters.list()] == [second.id]
            assert await publisher.groups() == []


async def _advisory_seen(bus: Bus) -> None:
    directory = bus.transport._groups  # type: ignore[union-attr]
    while directory.known("orders.created") not in (None, ()):
        await anyio.sleep(0.01)


async def test_deleting_a_group_other_processes_read_is_refused_unless_forced(
    kind: str, url: str, unique_prefix: str
) -> None:
    worker = Bus(transport=make_transport(kind, url, unique_prefix))

    @worker.subscribe("jobs", group="workers")
    async def work(n: int) -> None:
        pass

    with anyio.fail_after(60):
        async with worker, Bus(transport=make_transport(kind, url, unique_prefix)) as console:
            await worker.subscribed()
            await worker.publish("jobs", 1)
            await worker.drain(timeout=30)
            (info,) = await _with_a_consumer(console)
            assert (info.name, info.local, info.consumers) == ("jobs@workers", False, 1)
            with pytest.raises(ConfigurationError, match="consumer"):
                await console.delete_group("jobs", "workers")
            assert await console.delete_group("jobs", "workers", force=True) is True


async def _with_a_consumer(bus: Bus) -> list[GroupInfo]:
    """The groups, once the broker counts the worker's consumer (a NATS pull request
    may be between two pulls)."""
    while True:
        listed = await bus.groups()
        if all(info.consumers for info in listed):
            return listed
        await anyio.sleep(0.05)


async def test_a_publish_reaching_a_group_without_consumers_is_warned_of_once_per_interval(
    kind: str, url: str, unique_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    await _bind_old_group(kind, url, unique_prefix)
    caplog.set_level(logging.WARNING, logger="asyncbus.groups")

    def warnings() -> list[logging.LogRecord]:
        return [record for record in caplog.records if record.name == "asyncbus.groups"]

    with anyio.fail_after(60):
        async with Bus(
            transport=make_transport(kind, url, unique_prefix), stale_group_after=1.0
        ) as publisher:
            published = 0
            while not warnings():  # the watcher reads the groups every half second
                await publisher.publish("orders.created", published)
                published += 1
                await anyio.sleep(0.05)
            (warning,) = warnings()
            assert (warning.stage, warning.topic) == ("orders.*@old", "orders.created")  # type: ignore[attr-defined]
            assert "has had no consumer" in warning.getMessage()
            # Within the interval, the group is not warned of again.
            await publisher.publish("orders.created", published)
            assert len(warnings()) == 1


async def test_a_partitioned_group_is_deleted_with_the_groups_of_its_partitions(
    kind: str, url: str, unique_prefix: str
) -> None:
    """A group subscribed with ``partitions=N`` is a broker group per partition: deleting
    the group deletes them all, so later publishes reach none of them."""
    old = Bus(transport=make_transport(kind, url, unique_prefix))

    @old.subscribe("orders", group="g", ordering="key", partitions=4)
    async def handle(n: int) -> None:
        raise AssertionError("the partitioned group's process is gone")

    console = Bus(transport=make_transport(kind, url, unique_prefix))
    with anyio.fail_after(60):
        async with old:
            await old.subscribed()
        async with console:
            receipt = await console.publish("orders", 1, key="k")
            assert receipt.accepted == ("orders@g",)
            assert {info.pattern for info in await console.groups()} == {"orders"}
            assert await console.delete_group("orders", "g") is True
            assert await console.delete_group("orders", "g") is False
            assert await console.groups() == []
            receipt = await console.publish("orders", 2, key="k")
            assert receipt.accepted == ()
