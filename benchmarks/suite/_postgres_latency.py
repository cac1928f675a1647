"""The outbox's latency in ``python -m asyncbus bench postgres`` (see :mod:`._postgres`):
what a transactional publish costs end to end, written by ``PostgresTransport`` itself
or through ``PostgresOutbox``'s relay to a broker.

Three paths, each a fresh ``Bus`` with one subscription (group ``bench``,
``concurrency=8``) whose handler stamps its start:

* **transport**: ``Bus(transport=PostgresTransport(dsn, schema=...))``: ``publish(topic,
  payload, connection=conn)`` writes the transport's rows itself, in the caller's
  transaction; they are claimable once it commits. The baseline.
* **outbox to redis**: ``Bus(transport=RedisTransport(url, prefix=...),
  outbox=PostgresOutbox(dsn, schema=...))``: the publish writes an outbox row in the
  caller's transaction; the bus's relay, woken by the notification the commit delivers,
  forwards it to Redis. The outbox's purpose: a transactional publish for a bus whose
  broker is not the database.
* **outbox to postgres**: the same outbox forwarding through ``PostgresTransport``: the
  relay's hop within one database (a second durable commit before the claim). Over
  ``PostgresTransport`` the outbox is not needed (the transport path does the same in
  one commit); measured to show what the hop itself costs.

One publisher on a connection of its own, one publish at a time: ``async with
conn.transaction(): await bus.publish(topic, {"id": i, "t": perf_counter()},
connection=conn)``, then it waits for the handler to have started before the next (no
queueing). The latency of an envelope is its handler's start less the stamp it carries
(``time.perf_counter``: one process, one clock): the publish, the commit, the relay if
any, the claim and the hand-out. Also kept: the part spent in the caller's transaction
(the stamp until the commit returned). The first ``WARM_UP`` publishes of a run are not
counted (statements being prepared, connections opened). A path whose broker does not
answer is skipped with a note.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any
from urllib.parse import urlsplit

import anyio

from asyncbus import Bus
from asyncbus.transports.base import Transport
from asyncbus.transports.postgres import PostgresOutbox, PostgresTransport
from asyncbus.transports.redis import RedisTransport

from ._brokers import REDIS_URL, redis_delete_prefix
from ._postgres_runs import CONCURRENCY, GROUP, TOPIC, drop_schema, new_schema

__all__ = ["BASELINE", "OUTBOX_PATHS", "PATHS", "WARM_UP", "Latencies", "latency_run", "quantile"]

#: The paths, in the order each round runs them: name -> the broker the outbox forwards
#: to (``None``: no outbox, the transport writes in the caller's transaction).
PATHS: dict[str, str | None] = {
    "transport": None,
    "outbox to redis": "redis",
    "outbox to postgres": "postgres",
}
#: The path every other one is compared with.
BASELINE = "transport"
#: The paths through the outbox.
OUTBOX_PATHS = [path for path, via in PATHS.items() if via is not None]
#: Publishes of a run before the counted ones.
WARM_UP = 20
#: Longest wait for one envelope's handler.
TIMEOUT = 10.0


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (inclusive method, as ``statistics.quantiles``)."""
    if len(values) == 1:
        return values[0]
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return cuts[round(q * 100) - 1]


@dataclass(frozen=True)
class Latencies:
    """One run of a path: per counted envelope, seconds from the publish call to its
    handler's start, and from the publish call until the caller's commit returned."""

    end_to_end: list[float]
    in_transaction: list[float]

    def p(self, q: float) -> float:
        """The ``q`` quantile of the end-to-end latencies."""
        return quantile(self.end_to_end, q)


async def latency_run(
    dsn: str, publishes: int, *, via: str | None, redis_url: str = REDIS_URL
) -> Latencies:
    """``publishes`` transactional publishes, one at a time, written by the transport
    (``via=None``) or through the outbox to ``"redis"`` or ``"postgres"``."""
    import asyncpg

    schema = new_schema("lat")
    outbox_schema = new_schema("latob")
    prefix = f"bench-lat-{schema[-8:]}"
    transport: Transport = (
        RedisTransport(redis_url, prefix=prefix)
        if via == "redis"
        else PostgresTransport(dsn, schema=schema)
    )
    bus = Bus(
        transport=transport,
        outbox=PostgresOutbox(dsn, schema=outbox_schema) if via is not None else None,
    )
    end_to_end: list[float] = []
    in_transaction: list[float] = []
    arrived = anyio.Event()

    async def handle(payload: dict[str, Any]) -> None:
        started = perf_counter()
        if payload["id"] >= WARM_UP:
            end_to_end.append(started - payload["t"])
        arrived.set()

    bus.subscribe(TOPIC, handle, group=GROUP, concurrency=CONCURRENCY)
    caller = await asyncpg.connect(dsn)
    try:
        async with bus:
            publish = bus.publish
            for i in range(WARM_UP + publishes):
                arrived = anyio.Event()
                async with caller.transaction():
                    stamp = perf_counter()
                    await publish(TOPIC, {"id": i, "t": stamp}, connection=caller)
                committed = perf_counter()
                with anyio.fail_after(TIMEOUT):
                    await arrived.wait()
                if i >= WARM_UP:
                    in_transaction.append(committed - stamp)
        if len(end_to_end) != publishes:
            raise RuntimeError(f"handled {len(end_to_end)} counted envelopes, expected {publishes}")
        return Latencies(end_to_end, in_transaction)
    finally:
        with anyio.CancelScope(shield=True):
            await caller.close()
        await drop_schema(dsn, schema)
        await drop_schema(dsn, outbox_schema)
        if via == "redis":
            with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                await redis_delete_prefix(redis_url, prefix)


async def measure_latency(
    dsn: str, publishes: int, rounds: int, *, redis_url: str = REDIS_URL
) -> tuple[dict[str, list[Latencies]], dict[str, str]]:
    """Alternate the paths ``rounds`` times (after one short warm-up run of each); also
    the paths skipped, and why (their broker did not answer)."""
    skipped: dict[str, str] = {}
    if not reachable(redis_url):
        skipped["outbox to redis"] = f"nothing listens on {urlsplit(redis_url).netloc}"
    paths = {path: via for path, via in PATHS.items() if path not in skipped}
    for via in paths.values():
        with anyio.fail_after(60):
            await latency_run(dsn, 1, via=via, redis_url=redis_url)
    found: dict[str, list[Latencies]] = {path: [] for path in paths}
    for _ in range(rounds):
        for path, via in paths.items():
            with anyio.fail_after(60 + publishes * TIMEOUT / 100):
                found[path].append(await latency_run(dsn, publishes, via=via, redis_url=redis_url))
    return found, skipped


def reachable(url: str, default_port: int = 6379) -> bool:
    """Whether the host and port of ``url`` accept a TCP connection."""
    parts = urlsplit(url)
    address = (parts.hostname or "127.0.0.1", parts.port or default_port)
    try:
        with socket.create_connection(address, 1.0):
            return True
    except OSError:
        return False


def p50_ratios(found: dict[str, list[Latencies]], path: str) -> list[float]:
    """The p50 of ``path`` over the baseline's, round by round."""
    return [
        run.p(0.5) / direct.p(0.5) for run, direct in zip(found[path], found[BASELINE], strict=True)
    ]


def latency_report(
    found: dict[str, list[Latencies]], skipped: dict[str, str], publishes: int
) -> list[str]:
    """The latency table: per path, medians over the rounds of p50 and p90; the ratios."""
    rounds = len(found[BASELINE])
    lines = [
        f"Transactional publish latency ({publishes:,} publishes per run, one at a time, each "
        "in a transaction of its own; publish call -> handler start), medians of "
        f"{rounds} alternating rounds, ms",
        f"  {'path':<20} {'p50':>7} {'p90':>7} {'in tx p50':>10}   rounds (p50)",
    ]
    for path in PATHS:
        if path in skipped:
            lines.append(f"  {path:<20} skipped: {skipped[path]}")
            continue
        runs = found[path]
        p50 = statistics.median(run.p(0.5) for run in runs)
        p90 = statistics.median(run.p(0.9) for run in runs)
        held = statistics.median(quantile(run.in_transaction, 0.5) for run in runs)
        each = " ".join(f"{run.p(0.5) * 1e3:.2f}" for run in runs)
        lines.append(
            f"  {path:<20} {p50 * 1e3:>7.2f} {p90 * 1e3:>7.2f} {held * 1e3:>10.2f}   {each}"
        )
    for path in OUTBOX_PATHS:
        if path in found:
            ratios = p50_ratios(found, path)
            ratio = statistics.median(ratios)
            lines.append(
                f"  {path} / {BASELINE} p50: {ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            )
    lines.append("  (in tx = the stamp until the caller's commit returned)")
    return lines
