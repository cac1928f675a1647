"""The outbox's latency in ``python -m asyncbus bench postgres`` (see :mod:`._postgres`):
what forwarding through ``PostgresOutbox`` adds to a transactional publish, end to end.

Two paths, each a fresh ``Bus`` over ``PostgresTransport`` (a schema of its own) with one
subscription (group ``bench``, ``concurrency=8``) whose handler stamps its start:

* **transport**: ``Bus(transport=PostgresTransport(dsn, schema=...))``: ``publish(topic,
  payload, connection=conn)`` writes the transport's rows itself, in the caller's
  transaction; they are claimable once it commits.
* **outbox**: the same with ``outbox=PostgresOutbox(dsn, schema=...)`` (a schema of its
  own): the publish writes an outbox row in the caller's transaction; the bus's relay,
  woken by the notification the commit delivers, forwards it through the transport.

One publisher on a connection of its own, one publish at a time: ``async with
conn.transaction(): await bus.publish(topic, {"id": i, "t": perf_counter()},
connection=conn)``, then it waits for the handler to have started before the next (no
queueing). The latency of an envelope is its handler's start less the stamp it carries
(``time.perf_counter``: one process, one clock): the publish, the commit, the relay if
any, the claim and the hand-out. Also kept: the part spent in the caller's transaction
(the stamp until the commit returned). The first ``WARM_UP`` publishes of a run are not
counted (statements being prepared, connections opened).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import anyio

from asyncbus import Bus
from asyncbus.transports.postgres import PostgresOutbox, PostgresTransport

from ._postgres_runs import CONCURRENCY, GROUP, TOPIC, drop_schema, new_schema

__all__ = ["PATHS", "WARM_UP", "Latencies", "latency_run", "quantile"]

#: The paths, in the order each round runs them: name -> whether through the outbox.
PATHS = {"transport": False, "outbox": True}
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


async def latency_run(dsn: str, publishes: int, *, outbox: bool) -> Latencies:
    """``publishes`` transactional publishes, one at a time, through the outbox or not."""
    import asyncpg

    schema = new_schema("lat")
    outbox_schema = new_schema("latob")
    transport = PostgresTransport(dsn, schema=schema)
    bus = Bus(
        transport=transport, outbox=PostgresOutbox(dsn, schema=outbox_schema) if outbox else None
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


async def measure_latency(dsn: str, publishes: int, rounds: int) -> dict[str, list[Latencies]]:
    """Alternate the paths ``rounds`` times (after one short warm-up run of each)."""
    for outbox in PATHS.values():
        with anyio.fail_after(60):
            await latency_run(dsn, 1, outbox=outbox)
    found: dict[str, list[Latencies]] = {path: [] for path in PATHS}
    for _ in range(rounds):
        for path, outbox in PATHS.items():
            with anyio.fail_after(60 + publishes * TIMEOUT / 100):
                found[path].append(await latency_run(dsn, publishes, outbox=outbox))
    return found


def p50_ratios(found: dict[str, list[Latencies]]) -> list[float]:
    """The outbox's p50 over the transport's, round by round."""
    return [
        outbox.p(0.5) / direct.p(0.5)
        for outbox, direct in zip(found["outbox"], found["transport"], strict=True)
    ]


def latency_report(found: dict[str, list[Latencies]], publishes: int) -> list[str]:
    """The latency table: per path, medians over the rounds of p50 and p90, and the ratio."""
    rounds = len(found["transport"])
    lines = [
        f"Transactional publish latency ({publishes:,} publishes per run, one at a time, each "
        "in a transaction of its own; publish call -> handler start), medians of "
        f"{rounds} alternating rounds, ms",
        f"  {'path':<10} {'p50':>7} {'p90':>7} {'in tx p50':>10}   rounds (p50)",
    ]
    for path, runs in found.items():
        p50 = statistics.median(run.p(0.5) for run in runs)
        p90 = statistics.median(run.p(0.9) for run in runs)
        held = statistics.median(quantile(run.in_transaction, 0.5) for run in runs)
        each = " ".join(f"{run.p(0.5) * 1e3:.2f}" for run in runs)
        lines.append(
            f"  {path:<10} {p50 * 1e3:>7.2f} {p90 * 1e3:>7.2f} {held * 1e3:>10.2f}   {each}"
        )
    ratios = p50_ratios(found)
    ratio = statistics.median(ratios)
    lines.append(
        f"  outbox / transport p50: {ratio:.2f} ({min(ratios):.2f}-{max(ratios):.2f}): "
        f"the outbox's relay adds {ratio - 1:+.0%} (in tx = the stamp until the commit returned)"
    )
    return lines
