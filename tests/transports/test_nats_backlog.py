"""A backlog read on a replicated NATS stream counts what the stream's leader confirmed.

A replicated consumer's leader counts from its own copy of the stream, which may be a
moment behind the stream's leader that confirmed a publish (seen here on a loaded
machine: a read of 0 right after 5 confirmed publishes). ``group_backlog`` reads the
count again once the stream's leader reports that copy caught up. The broker's side
(followers applying a moment late) cannot be produced on demand, so these tests give
``group_backlog`` a JetStream manager that answers as such a cluster does; the
cluster's conformance suite reads backlogs on a real three-node cluster.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from asyncbus.transports import _nats_groups
from asyncbus.transports._nats_groups import group_backlog

pytest.importorskip("nats")

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


class _Cluster:
    """Answers ``consumer_info`` and ``stream_info`` as a three-node cluster whose
    consumer leader (n2) is not the stream's leader (n1): the copy on n2 holds
    ``held`` of the 5 confirmed messages until it has been looked at ``lagging``
    times."""

    def __init__(self, *, lagging: int, consumer_leader: str = "n2") -> None:
        self.lagging = lagging
        self.consumer_leader = consumer_leader
        self.looks = 0
        self.consumer_reads = 0

    async def consumer_info(self, stream: str, name: str) -> Any:
        from nats.js.api import ClusterInfo, PeerInfo

        self.consumer_reads += 1
        held = 5 if self.looks >= self.lagging else 1
        return SimpleNamespace(
            num_pending=held,
            num_ack_pending=0,
            cluster=ClusterInfo(
                leader=self.consumer_leader,
                replicas=[PeerInfo(name="n1", current=True, lag=0)],
            ),
        )

    async def stream_info(self, stream: str) -> Any:
        from nats.js.api import ClusterInfo, PeerInfo

        self.looks += 1
        behind = self.looks < self.lagging
        cluster = ClusterInfo(
            leader="n1",
            replicas=[
                PeerInfo(name="n2", current=not behind, lag=3 if behind else 0),
                PeerInfo(name="n3", current=True, lag=0),
            ],
        )
        return SimpleNamespace(cluster=cluster)


async def test_a_lagging_consumer_leader_is_read_again_once_caught_up() -> None:
    cluster = _Cluster(lagging=3)
    assert await group_backlog(cluster, "S", "g") == 5  # type: ignore[arg-type]
    assert (cluster.looks, cluster.consumer_reads) == (3, 2)


async def test_a_consumer_led_by_the_streams_leader_is_read_once() -> None:
    cluster = _Cluster(lagging=0, consumer_leader="n1")
    assert await group_backlog(cluster, "S", "g") == 5  # type: ignore[arg-type]
    assert (cluster.looks, cluster.consumer_reads) == (1, 1)


async def test_a_copy_that_never_catches_up_is_read_once_the_wait_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_nats_groups, "_CATCH_UP", 0.05)
    cluster = _Cluster(lagging=10**9)
    assert await group_backlog(cluster, "S", "g") == 1  # type: ignore[arg-type]
    assert cluster.consumer_reads == 2
