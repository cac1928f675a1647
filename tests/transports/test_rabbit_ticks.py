"""Periodic ticks over RabbitMQ: one replica leads a schedule (its connection holds the
schedule's exclusive lock queue), writes down what it published, and hands over when
its connection goes; a record that is not ours is ignored with a warning."""

from __future__ import annotations

import logging
import time

import anyio
import pytest

from asyncbus import TransportError
from asyncbus._dedup import Claim
from asyncbus.transports import RabbitTransport, TickClaimsProvider, _rabbit_ticks
from asyncbus.transports._rabbit_ticks import KEPT, _Schedule

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def key(tick: int | str, name: str = "beat") -> str:
    return f"_asyncbus.periodic.{name}/{tick}"


def test_a_record_keeps_the_newest_ticks_and_counts_older_ones_published() -> None:
    schedule = _Schedule(lock="l", record="r")
    assert not schedule.is_done(None) and not schedule.is_done(5)
    for tick in range(KEPT + 10, 0, -1):  # out of order
        schedule.mark(tick)
    assert schedule.published == list(range(11, KEPT + 11))
    assert schedule.is_done(3)  # older than every kept one: published long ago
    assert not schedule.is_done(KEPT + 11)
    copy = _Schedule(lock="l", record="r")
    copy.read(schedule.document())
    assert copy.published == schedule.published and not copy.known
    schedule.mark(None)
    copy.read(schedule.document())
    assert copy.known


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b'{"v": 2, "published": []}',
        b'{"v": 1, "published": ["1"]}',
        b'{"v": 1}',
        b'{"v": 1, "published": [1.5]}',
    ],
)
def test_a_record_that_is_not_ours_is_ignored_with_a_warning(
    body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    schedule = _Schedule(lock="l", record="the-record")
    schedule.mark(7)
    with caplog.at_level(logging.WARNING, "asyncbus.transport.rabbit"):
        schedule.read(body)
    assert (schedule.published, schedule.known) == ([7], False)
    [warning] = [record.getMessage() for record in caplog.records]
    assert warning.startswith("RabbitMQ: the ticks record the-record is unreadable: ")


async def test_keys_other_than_ticks_are_refused(rabbit_url: str, rabbit_prefix: str) -> None:
    async with RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport:
        with pytest.raises(ValueError, match="not a periodic tick's key"):
            await transport.tick_claims().claim("stage/envelope-id", "me", 5.0)


@pytest.mark.backends("asyncio")
async def test_one_replica_leads_and_the_next_takes_over_what_it_left(
    rabbit_url: str, rabbit_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_rabbit_ticks, "RECHECK", 0.0)  # a follower looks at every claim
    first = RabbitTransport(rabbit_url, prefix=rabbit_prefix)
    second = RabbitTransport(rabbit_url, prefix=rabbit_prefix)
    assert isinstance(first, TickClaimsProvider)
    with anyio.fail_after(30):
        async with second:
            follower = second.tick_claims()
            async with first:
                leader = first.tick_claims()
                assert await leader.claim(key("known"), "a", 5.0) is Claim.CLAIMED
                await leader.done(key("known"), "a", 60.0)
                assert await leader.claim(key(100), "a", 5.0) is Claim.CLAIMED
                assert await leader.claim(key(100), "a2", 5.0) is Claim.BUSY  # its own lease
                await leader.done(key(100), "a", 60.0)
                assert await leader.claim(key(100), "a", 5.0) is Claim.DONE
                assert await leader.claim(key(200), "a", 5.0) is Claim.CLAIMED  # left undone
                assert await follower.claim(key(100), "b", 5.0) is Claim.BUSY
                assert await follower.claim(key(200), "b", 5.0) is Claim.BUSY
                # another schedule has a lock of its own: the follower may lead that one
                assert await follower.claim(key(1, name="other"), "b", 5.0) is Claim.CLAIMED
            # the leader's connection closed: its lock went with it
            assert await follower.claim(key("known"), "b", 5.0) is Claim.DONE
            assert await follower.claim(key(100), "b", 5.0) is Claim.DONE
            assert await follower.claim(key(200), "b", 5.0) is Claim.CLAIMED
            await follower.release(key(200), "b")
            assert await follower.claim(key(200), "c", 5.0) is Claim.CLAIMED


@pytest.mark.backends("asyncio")
async def test_a_new_leader_learns_the_last_tick_of_a_leader_alive_a_moment_ago(
    rabbit_url: str, rabbit_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_rabbit_ticks, "RECHECK", 0.0)
    recent = int(time.time() * 1000) - 1_000  # a second ago
    old = int(time.time() * 1000) - 60_000  # a minute ago: every replica was down since
    with anyio.fail_after(30):
        for newest, handed in ((recent, recent / 1000), (old, None)):
            name = f"s{newest}"
            async with RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport:
                first = transport.tick_claims()
                assert await first.claim(key(newest, name), "a", 5.0) is Claim.CLAIMED
                await first.done(key(newest, name), "a", 60.0)
                assert first.handed_over(key(newest, name)) is None  # it led from the start
            async with RabbitTransport(rabbit_url, prefix=rabbit_prefix) as transport:
                second = transport.tick_claims()
                assert await second.claim(key(newest + 100, name), "b", 5.0) is Claim.CLAIMED
                assert second.handed_over(key(newest + 100, name)) == handed
                assert second.handed_over(key(newest + 100, name)) is None  # (once)


async def test_what_the_client_raises_while_looking_at_the_lead_is_a_transport_error() -> None:
    class Closed:
        async def channel(self, **options: object) -> object:
            raise ConnectionResetError("the connection is closing")

    class Link:
        publisher = Closed()

    link = Link()

    async def live_link() -> Link:
        return link

    async def keep(queue: str, body: bytes) -> None:
        raise AssertionError("nothing is written by a replica that does not lead")

    async def declare(queue: str) -> None:
        raise AssertionError("the lock is looked at first")

    leader = _rabbit_ticks.TickLeader(
        "p",
        live_link,  # type: ignore[arg-type]
        lambda: link,  # type: ignore[arg-type,return-value]
        keep,
        declare,
    )
    with pytest.raises(TransportError, match="ConnectionResetError: the connection is closing"):
        await leader.claim(key(100), "a", 5.0)
