"""A publish fanned out to several groups: one Redis server against a Redis Cluster.

``python benchmarks/cluster_fanout.py --redis-cluster URLS [--redis URL] [--groups 1,3]
[--messages 20000] [--in-flight 100] [--rounds 5] [--check]``
(also ``python -m asyncbus bench fanout ...``)

On a cluster each group's stream has a hash tag of its own, so a deployment's groups
spread over the masters; a publish reaching groups in several slots is one write per
slot (after one read of the bindings' version), where one server takes one script call
for every group. For ``G`` groups bound to one topic (names picked so that, on the
cluster, they fall on as many masters as there are), ``messages`` single-envelope
publishes are sent by ``in-flight`` concurrent tasks through a bare
:class:`~asyncbus.transports.redis.RedisTransport` (nothing consumes: the write side
only), on the server and on the cluster in alternating rounds. It prints publishes per
second (median and spread of the rounds), the cluster's ratio to the one server, and
the masters the groups are on.

On one machine every master shares the same cores: the cluster pays a round trip and
the client's CPU per slot, and gains nothing from more masters. On machines of their
own each master takes its slots' writes on its own core. ``--check`` exits 1 when a
group's stream does not hold exactly the envelopes published; there is no throughput
target.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from typing import Any

import anyio

from asyncbus import Envelope
from suite._brokers import redis_delete_prefix

TOPIC = "fanout.jobs"


async def _masters_of(transport: Any, streams: list[str]) -> list[str]:
    """The address of the master each stream's slot is on (``-`` on one server)."""
    if not transport.cluster:
        return ["-"] * len(streams)
    client = transport._redis()
    masters = []
    for stream in streams:
        node = client.get_node_from_key(stream)
        masters.append(f"{node.host}:{node.port}")
    return masters


async def _group_names(transport: Any, count: int) -> list[str]:
    """``count`` group names whose streams fall on as many masters as can be (on a
    cluster; on one server the first names)."""
    names = [f"g{n}" for n in range(count)]
    if not transport.cluster:
        return names
    client = transport._redis()
    masters = {f"{node.host}:{node.port}" for node in client.get_primaries()}
    picked: list[str] = []
    seen: set[str] = set()
    for n in range(1000):
        name = f"g{n}"
        node = client.get_node_from_key(transport.stream_key(TOPIC, name))
        address = f"{node.host}:{node.port}"
        if address not in seen or len(seen) == len(masters):
            seen.add(address)
            picked.append(name)
        if len(picked) == count:
            return picked
    return names


async def one_round(
    url: str, cluster: bool, groups: int, messages: int, in_flight: int
) -> tuple[float, list[str], list[int]]:
    """Publishes per second, the groups' masters, and each group's stream length."""
    from asyncbus.transports.redis import RedisTransport

    prefix = f"fanout-{secrets.token_hex(4)}"
    transport = RedisTransport(url.split(",") if cluster else url, prefix=prefix, cluster=cluster)
    try:
        async with transport:
            names = await _group_names(transport, groups)
            streams = [await transport._bindings.bind_raw(TOPIC, name) for name in names]

            async def publisher(first: int) -> None:
                for n in range(first, messages, in_flight):
                    await transport.publish(TOPIC, [Envelope(topic=TOPIC, payload=n)])

            began = time.perf_counter()
            async with anyio.create_task_group() as publishers:
                for first in range(in_flight):
                    publishers.start_soon(publisher, first)
            rate = messages / (time.perf_counter() - began)
            client = transport._redis()
            lengths = [int(await client.xlen(stream)) for stream in streams]
            masters = await _masters_of(transport, streams)
            if cluster:  # the shared keys ({prefix}) and the groups' ({prefix:stage:...})
                async for key in client.scan_iter(match=f"{{{prefix}*"):
                    await client.delete(key)
    finally:
        if not cluster:
            await redis_delete_prefix(url, prefix)
    return rate, masters, lengths


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; 1 with ``--check`` when a stream lost or doubled one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-cluster", required=True, help="node URLs, comma-separated")
    parser.add_argument("--groups", default="1,3")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--in-flight", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    options = parser.parse_args(argv)
    wrong = 0
    print(f"{options.messages} publishes of one envelope, {options.in_flight} in flight")
    rows = []
    for groups in (int(part) for part in options.groups.split(",")):
        rates: dict[str, list[float]] = {"one server": [], "cluster": []}
        masters: list[str] = []
        for _ in range(options.rounds):
            for label, url, cluster in (
                ("one server", options.redis, False),
                ("cluster", options.redis_cluster, True),
            ):
                rate, where, lengths = anyio.run(
                    one_round, url, cluster, groups, options.messages, options.in_flight
                )
                rates[label].append(rate)
                if cluster:
                    masters = where
                if lengths != [options.messages] * groups:
                    wrong += 1
                    print(f"{label}, {groups} groups: streams hold {lengths}", file=sys.stderr)
        one = statistics.median(rates["one server"])
        spread = statistics.median(rates["cluster"])
        rows.append((groups, one, rates["one server"], spread, rates["cluster"], masters))
    print("| groups | one server (publishes/s) | cluster (publishes/s) | ratio | masters |")
    print("| --- | --- | --- | --- | --- |")
    for groups, one, ones, spread, spreads, masters in rows:
        print(
            f"| {groups} | {one:,.0f} ({min(ones):,.0f}-{max(ones):,.0f}) | "
            f"{spread:,.0f} ({min(spreads):,.0f}-{max(spreads):,.0f}) | "
            f"{spread / one:.2f}x | {len(set(masters))} |"
        )
    return 1 if options.check and wrong else 0


if __name__ == "__main__":
    sys.exit(main())
