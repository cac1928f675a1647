"""PostgreSQL end to end: ``Bus(transport=PostgresTransport(...))`` against hand-written asyncpg.

Every side moves the same ``--messages`` small dicts (``{"id": i, "kind":
"order.created", "amount": 12.5}``, built before timing) through the same local server,
in tables of the same design (the transport's: one row per group a publish reaches,
routed by the groups table's regular expressions in the insert itself, a claim an
``UPDATE ... FOR UPDATE SKIP LOCKED`` of the oldest available rows, ``pg_notify`` with the
group's id in the statement that writes, an ack a ``DELETE``). Each run has a schema of
its own, dropped afterwards. A run is timed from the first publish until every envelope
was handled *and acked* (for asyncbus: ``bus.drain()``), then checked outside the timed
span: exactly N handled per group and no row left (a run that fails the check is an
error, not a time).

* **asyncbus**: ``Bus(transport=PostgresTransport(dsn, schema=...))`` (its defaults: a
  pool of 10 connections), one subscription (group ``bench``, ``concurrency=8``,
  ``capacity=256``) whose handler counts; a task group of 100 publisher tasks, each
  ``await bus.publish(topic, payload)`` in turn (100 in flight).
* **hand-written**: asyncpg as one would write it over the same tables: a pool of 10
  connections and the same 100 publisher tasks, each one autocommitted ``INSERT ...
  SELECT`` of the row for every group whose pattern matches, notifying them in the same
  statement; one consumer task on a connection of its own claiming up to 100 rows at a
  time with the transport's
  claim statement, handling them, and deleting the batch in one ``DELETE ... WHERE seq
  = ANY(...)``; with nothing to claim it waits for a notification (``LISTEN``) or 1 s.
* **asyncbus batch**: the same Bus, ``PUBLISHERS`` (4) tasks each ``await
  bus.publish_many(topic, chunk)`` of the next 100 in turn; one subscription with
  ``batch=Batch(max_size=100, max_wait=0)`` (``concurrency=8``, ``capacity=256``)
  counting each list: it hands over what is queued, up to 100, and goes, as the
  hand-written consumer handles what one claim brings.
* **asyncbus batch, linger** (reported, not judged): the same with ``Batch``'s default
  ``max_wait`` of 50 ms: a batch of fewer than 100 waits up to 50 ms to fill. At the end
  of a run nothing more comes, so the last batches wait their full 50 ms: on a run of
  5,000 envelopes (about a quarter of a second) that tail is what separates the two
  rows, a cost of the run's length, not of throughput.
* **hand-written batch**: the same 4 tasks, each inserting its chunk of 100 in one
  statement (``unnest`` of arrays); the same consumer.
* **asyncbus 3 groups** / **hand-written 3 groups**: the single-publish sides with three
  groups on the topic (``bench-0..2``; three subscriptions, or three consumer tasks), so
  each publish writes three rows and 3N deliveries are handled and acked. The ratio to
  the one-group side of the same round is the end-to-end cost of a row per group.

Runs alternate (A B C ... A B C ..., after one untimed warm-up of each) so a slow spell
of the shared machine falls on every side. **env/s** is envelopes published per second
(each handled once per group), **µs/env** its inverse, both medians over the rounds;
each **x** column is the median of the per-round ratios to one baseline of the same
round, with their spread (min-max). With ``--check`` the maintainers' targets are
judged (:data:`TARGETS`; exit status 1 when one is missed). A run of asyncbus that fails
is exit status 1 either way.

* **pgqueuer** / **procrastinate**: the PostgreSQL job queues a user would pick instead,
  doing the asyncbus side's work (the same payloads enqueued by the same 100 producer
  tasks, one worker task consuming, each job decoded and counted), each in a schema of
  its own; timed until every job is handled and its completion written (see
  :mod:`._postgres_peers`). A peer whose package is not installed is skipped with a note
  (and its target, under ``--check``, fails).

Then the transactional publish latency (``--publishes`` per run, 500 by default; 0
leaves it out): ``publish(topic, payload, connection=conn)`` one at a time, each in a
transaction of its own, written by ``PostgresTransport`` itself and through
``PostgresOutbox``'s relay to Redis (``--redis-url``) and to ``PostgresTransport``, from
the publish call to the handler's start; p50 and p90 per path and the ratios of the p50s
(see :mod:`._postgres_latency`); ``--check`` judges the outbox's target on the path to
Redis.

``--fanout 1,3,10`` adds the design measurement: publishing only (nothing consumes),
``--messages`` single publishes from 100 tasks into a topic that reaches 1, 3 or 10
groups (alternating, ``--rounds`` times), reporting the publish time per envelope, the
rows written per envelope and the growth of the messages table (heap, indexes and
TOAST) and of the server's write-ahead log per envelope.

The runs themselves live in :mod:`._postgres_runs`; this module alternates them,
reports and judges.

Run: ``python -m asyncbus bench postgres [--messages N] [--rounds R] [--check]
[--publishes N] [--fanout 1,3,10] [--dsn DSN] [--loop uvloop|asyncio]`` (or ``python
benchmarks/postgres_bench.py``). Skipped with a note (exit status 0) when nothing
listens at the DSN's address.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from ._brokers import IN_FLIGHT, REDIS_URL
from ._postgres_latency import BASELINE, Latencies, latency_report, measure_latency, p50_ratios
from ._postgres_latency import reachable as port_open
from ._postgres_peers import PEERS, missing, peer_run
from ._postgres_runs import (
    BATCH,
    CAPACITY,
    CONCURRENCY,
    DSN,
    FANOUT,
    LINGER,
    POOL,
    PUBLISHERS,
    WARM_UP,
    Payload,
    Run,
    Written,
    asyncbus_run,
    fanout_run,
    hand_run,
    payloads,
)


@dataclass(frozen=True)
class Target:
    """A target ``--check`` judges: the median per-round ratio of ``side`` to
    ``baseline`` at least ``goal`` (``strict``: above it)."""

    side: str
    baseline: str
    goal: float
    strict: bool = False

    @property
    def goal_text(self) -> str:
        return f"{'>' if self.strict else '>='} {self.goal:g}x"

    def met(self, ratio: float) -> bool:
        return ratio > self.goal if self.strict else ratio >= self.goal


#: The targets ``--check`` judges. Single publishes, batches and three groups: at least
#: 0.8x the hand-written loop (the batch row like for like: handing over what is there,
#: as the hand-written consumer does). Against the peers, the job queues a user would
#: pick instead, asyncbus has to be ahead: above 1x.
TARGETS: tuple[Target, ...] = (
    Target("asyncbus", "hand-written", 0.8),
    Target("asyncbus batch", "hand-written batch", 0.8),
    Target(f"asyncbus {FANOUT} groups", f"hand-written {FANOUT} groups", 0.8),
    *(Target("asyncbus", peer, 1.0, strict=True) for peer in PEERS),
)
#: The ratio columns of the table: title -> baseline side.
COLUMNS = {
    "x hand": "hand-written",
    "x hand batch": "hand-written batch",
    "x hand 3 groups": "hand-written 3 groups",
}


# -- the sides -----------------------------------------------------------------------

Side = Callable[[str, Sequence[Payload]], Awaitable[Run]]


async def _asyncbus(dsn: str, messages: Sequence[Payload]) -> Run:
    return await asyncbus_run(dsn, messages)


async def _hand(dsn: str, messages: Sequence[Payload]) -> Run:
    return await hand_run(dsn, messages)


async def _asyncbus_batch(dsn: str, messages: Sequence[Payload]) -> Run:
    return await asyncbus_run(dsn, messages, batch=True)


async def _asyncbus_batch_linger(dsn: str, messages: Sequence[Payload]) -> Run:
    return await asyncbus_run(dsn, messages, batch=True, linger=LINGER)


async def _hand_batch(dsn: str, messages: Sequence[Payload]) -> Run:
    return await hand_run(dsn, messages, batch=True)


async def _asyncbus_fanout(dsn: str, messages: Sequence[Payload]) -> Run:
    return await asyncbus_run(dsn, messages, groups=FANOUT)


async def _hand_fanout(dsn: str, messages: Sequence[Payload]) -> Run:
    return await hand_run(dsn, messages, groups=FANOUT)


def _peer(peer: str) -> Side:
    async def run(dsn: str, messages: Sequence[Payload]) -> Run:
        return await peer_run(peer, dsn, messages)

    return run


#: The sides, in the order each round runs them.
SIDES: dict[str, Side] = {
    "asyncbus": _asyncbus,
    "hand-written": _hand,
    "asyncbus batch": _asyncbus_batch,
    "asyncbus batch, linger": _asyncbus_batch_linger,
    "hand-written batch": _hand_batch,
    f"asyncbus {FANOUT} groups": _asyncbus_fanout,
    f"hand-written {FANOUT} groups": _hand_fanout,
    **{peer: _peer(peer) for peer in PEERS},
}


@dataclass
class Result:
    """Each side's runs (one per round), its first error, if any, and the peers that
    cannot run here (why)."""

    runs: dict[str, list[Run]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    def rates(self, side: str, messages: int) -> list[float]:
        """Envelopes published per second, one per round."""
        return [messages / run.seconds for run in self.runs.get(side, [])]

    def per_round(self, side: str, baseline: str) -> list[float]:
        """Throughput of ``side`` over ``baseline``, round by round (both ran)."""
        return [
            b.seconds / a.seconds
            for a, b in zip(self.runs.get(side, []), self.runs.get(baseline, []), strict=False)
        ]


def describe(error: BaseException) -> str:
    """The first leaf of an exception group, as ``Type: message``."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


def run_timeout(count: int) -> float:
    """Bound of one run: generous, never endless."""
    return 60.0 + count * FANOUT / 250


async def measure(dsn: str, messages: int, rounds: int, sides: Sequence[str]) -> Result:
    """Warm up each side once, then alternate them ``rounds`` times."""
    result = Result()
    data = payloads(messages)
    for peer in PEERS:
        why = missing(peer) if peer in sides else None
        if why is not None:
            result.skipped[peer] = why
    sides = [side for side in sides if side not in result.skipped]
    for side in sides:
        try:
            with anyio.fail_after(run_timeout(WARM_UP)):
                await SIDES[side](dsn, data[: min(messages, WARM_UP)])
        except Exception as error:
            result.errors[side] = f"warm-up failed: {describe(error)}"
    for _ in range(rounds):
        for side in sides:
            if side in result.errors:
                continue
            gc.collect()
            try:
                with anyio.fail_after(run_timeout(messages)):
                    run = await SIDES[side](dsn, data)
            except Exception as error:
                result.errors[side] = describe(error)
                continue
            result.runs.setdefault(side, []).append(run)
    return result


async def measure_fanout(
    dsn: str, messages: int, rounds: int, fanouts: Sequence[int]
) -> dict[int, list[Written]]:
    """Alternate the fan-outs ``rounds`` times (after one warm-up of each)."""
    data = payloads(messages)
    for groups in fanouts:
        with anyio.fail_after(run_timeout(WARM_UP)):
            await fanout_run(dsn, data[: min(messages, WARM_UP)], groups)
    found: dict[int, list[Written]] = {groups: [] for groups in fanouts}
    for _ in range(rounds):
        for groups in fanouts:
            gc.collect()
            with anyio.fail_after(run_timeout(messages)):
                found[groups].append(await fanout_run(dsn, data, groups))
    return found


# -- the report ------------------------------------------------------------------------


def ratio_text(ratios: list[float]) -> str:
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def report(result: Result, messages: int, rounds: int, dsn: str) -> list[str]:
    """The end-to-end table: each side's medians, the ratio columns and the rounds."""
    columns = {title: base for title, base in COLUMNS.items() if base in SIDES}
    lines = [
        f"PostgreSQL ({address(dsn)}): {messages:,} envelopes per run, {rounds} alternating "
        "rounds, medians; timed until every envelope is handled and acked; env/s = envelopes "
        "published per second (each handled once per group); x = median of per-round "
        "throughput ratios (min-max)",
        f"  {'implementation':<24} {'env/s':>8} {'µs/env':>8}"
        + "".join(f" {title:>17}" for title in columns)
        + "   rounds (env/s)",
    ]
    for side in SIDES:
        if side in result.errors:
            lines.append(f"  {side:<24} error: {result.errors[side]}")
            continue
        if side in result.skipped:
            lines.append(f"  {side:<24} skipped: {result.skipped[side]}")
            continue
        runs = result.runs.get(side)
        if not runs:
            continue
        per = statistics.median(run.seconds for run in runs) / messages
        shown = "".join(
            f" {ratio_text(result.per_round(side, base)):>17}" for base in columns.values()
        )
        each = " ".join(f"{rate:,.0f}" for rate in result.rates(side, messages))
        lines.append(f"  {side:<24} {1 / per:>8,.0f} {per * 1e6:>8.1f}{shown}   {each}")
    one, many = "asyncbus", f"asyncbus {FANOUT} groups"
    for a, b in ((one, many), ("hand-written", f"hand-written {FANOUT} groups")):
        if result.runs.get(a) and result.runs.get(b):
            lines.append(
                f"  {b} / {a}: {ratio_text(result.per_round(b, a))} of the envelope rate "
                f"({FANOUT}x the rows and deliveries)"
            )
    for peer in PEERS:
        if result.runs.get("asyncbus") and result.runs.get(peer):
            lines.append(
                f"  asyncbus / {peer}: {ratio_text(result.per_round('asyncbus', peer))} "
                "(throughput, the same jobs: 100 producers, one worker)"
            )
    cpu = [run.cpu for runs in result.runs.values() for run in runs]
    if cpu:
        lines.append(
            f"  CPU share of this process over the timed spans: {min(cpu):.0%}-{max(cpu):.0%} "
            f"(the server runs in its own processes on the same {os.cpu_count()} CPUs)"
        )
    return lines


def fanout_report(found: dict[int, list[Written]], messages: int) -> list[str]:
    """The publish-only table: per fan-out, medians over the rounds."""
    first = min(found)
    lines = [
        f"Fan-out, publishing only ({messages:,} single publishes from {IN_FLIGHT} tasks, "
        f"nothing consuming), medians of {len(found[first])} alternating rounds; "
        f"x {first} = median per-round ratio of publish time to {first} group(s)",
        f"  {'groups':>6} {'µs/env':>8} {'x ' + str(first):>17} {'rows/env':>9} "
        f"{'table B/env':>12} {'WAL B/env':>10} {'meta+body B/row':>16}",
    ]
    for groups, runs in found.items():
        per = statistics.median(run.seconds for run in runs) / messages
        ratios = [run.seconds / base.seconds for run, base in zip(runs, found[first], strict=False)]
        lines.append(
            f"  {groups:>6} {per * 1e6:>8.1f} {ratio_text(ratios):>17} "
            f"{statistics.median(run.rows for run in runs) / messages:>9.1f} "
            f"{statistics.median(run.table_bytes for run in runs) / messages:>12,.0f} "
            f"{statistics.median(run.wal_bytes for run in runs) / messages:>10,.0f} "
            f"{statistics.median(run.row_bytes for run in runs):>16.0f}"
        )
    lines.append(
        "  (table: pg_total_relation_size of the messages table, heap + indexes + TOAST; "
        "WAL: the server's whole write-ahead log over the timed span, other databases' "
        "writes included)"
    )
    return lines


@dataclass(frozen=True)
class Verdict:
    """One target judged."""

    name: str
    goal: str
    measured: str
    verdict: str  # PASS or FAIL


def judge(result: Result) -> list[Verdict]:
    """Every target of :data:`TARGETS` on the median of its per-round ratios."""
    verdicts = []
    for target in TARGETS:
        side, baseline = target.side, target.baseline
        name, goal_text = f"{side} vs {baseline}", target.goal_text
        if baseline in result.skipped:
            verdicts.append(Verdict(name, goal_text, result.skipped[baseline], "FAIL"))
            continue
        if side in result.errors or baseline in result.errors:
            failed = side if side in result.errors else baseline
            verdicts.append(Verdict(name, goal_text, f"{failed} failed", "FAIL"))
            continue
        ratios = result.per_round(side, baseline)
        ratio = statistics.median(ratios)
        measured = f"{ratio:.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"
        verdicts.append(Verdict(name, goal_text, measured, "PASS" if target.met(ratio) else "FAIL"))
    return verdicts


#: The outbox's target: a transactional publish through the outbox to a broker takes at
#: most this share longer at p50, publish call to handler, than one written by
#: ``PostgresTransport`` itself (the path that needs no relay). Judged on the path the
#: outbox exists for, a broker that is not the database (Redis here); the relay's hop
#: within one database (``outbox to postgres``: a second durable commit before the
#: claim) is reported beside it, not judged (see docs/benchmarks.md).
OUTBOX_P50_TARGET = 0.20
#: The path the outbox's target is judged on.
OUTBOX_JUDGED = "outbox to redis"


def latency_verdict(found: dict[str, list[Latencies]], skipped: dict[str, str]) -> Verdict:
    """The outbox's target judged on :data:`OUTBOX_JUDGED`'s median per-round p50 ratio."""
    name = f"{OUTBOX_JUDGED} vs {BASELINE} (p50)"
    goal = f"<= {1 + OUTBOX_P50_TARGET:g}x"
    if OUTBOX_JUDGED in skipped:
        return Verdict(name, goal, skipped[OUTBOX_JUDGED], "FAIL")
    ratios = p50_ratios(found, OUTBOX_JUDGED)
    ratio = statistics.median(ratios)
    measured = f"{ratio:.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})"
    return Verdict(name, goal, measured, "PASS" if ratio <= 1 + OUTBOX_P50_TARGET else "FAIL")


def address(dsn: str) -> str:
    """``host:port`` of a DSN."""
    parts = urlsplit(dsn)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"


def reachable(dsn: str) -> bool:
    """Whether the server's port accepts a TCP connection."""
    return port_open(dsn, 5432)


def header(loop: str, server: str) -> list[str]:
    """Machine, versions and the shape of every side."""
    versions = []
    for package in ("asyncpg", "anyio", "uvloop", "pgqueuer", "procrastinate", "psycopg"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            versions.append(f"{package} {version(package)}")
    return [
        f"machine: {os.cpu_count()} CPUs ({platform.machine()}), "
        f"CPython {platform.python_version()}, "
        f"event loop: asyncio{' + uvloop' if loop == 'uvloop' else ''}",
        "packages: " + ", ".join(versions),
        f"server: {server} (loopback)",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"asyncbus: PostgresTransport defaults (pool of 10); one subscription per group "
        f"(concurrency {CONCURRENCY}, capacity {CAPACITY}); {IN_FLIGHT} publisher tasks; "
        f"batch: {PUBLISHERS} tasks of publish_many({BATCH}), Batch(max_size={BATCH}, "
        f"max_wait=0) (linger: max_wait={LINGER:g}, Batch's default)",
        f"hand-written: asyncpg pool of {POOL}, the same publishers (one autocommitted "
        f"INSERT each, or one of {BATCH} rows); one consumer task per group on a "
        f"connection of its own, claiming {BATCH} at a time, one DELETE per batch",
        f"peers: {IN_FLIGHT} producer tasks, one worker task with a pool of its own; pgqueuer "
        f"enqueue over an asyncpg pool of {POOL}, QueueManager defaults (batch_size 10); "
        f"procrastinate defer_async over a psycopg pool of {POOL}, run_worker_async("
        f"concurrency={CONCURRENCY}, delete_jobs='always')",
    ]


async def server_version(dsn: str) -> str:
    import asyncpg

    connection = await asyncpg.connect(dsn)
    try:
        return "PostgreSQL " + str(await connection.fetchval("SHOW server_version"))
    finally:
        await connection.close()


def main(argv: list[str] | None = None) -> int:
    """Command line: run and print the report; with ``--check``, exit 1 on a missed target."""
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench postgres", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--dsn", default=DSN, help="the server (loopback); default: %(default)s")
    parser.add_argument("--messages", type=int, default=5000, help="envelopes per run")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 3)")
    parser.add_argument(
        "--check", action="store_true", help="judge the targets too; exit 1 on FAIL"
    )
    parser.add_argument(
        "--fanout",
        default="",
        metavar="1,3,10",
        help="also publish only into topics reaching this many groups (rows and bytes)",
    )
    parser.add_argument("--only-fanout", action="store_true", help="the fan-out measurement alone")
    parser.add_argument(
        "--publishes",
        type=int,
        default=500,
        help="sequential transactional publishes per latency run, transport vs outbox "
        "(0: no latency runs); default: %(default)s",
    )
    parser.add_argument(
        "--redis-url",
        default=REDIS_URL,
        help="the Redis the outbox forwards to in the latency runs (loopback); "
        "default: %(default)s",
    )
    parser.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
    )
    options = parser.parse_args(argv)
    if options.messages < 1:
        parser.error("--messages must be >= 1")
    if options.rounds < 3:
        parser.error("--rounds must be >= 3 (medians of alternating rounds)")
    try:
        fanouts = [int(n) for n in options.fanout.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--fanout takes counts of groups like 1,3,10, got {options.fanout!r}")
    if any(n < 1 or n > 100 for n in fanouts):
        parser.error("--fanout: each count of groups from 1 to 100")
    if options.only_fanout and not fanouts:
        parser.error("--only-fanout needs --fanout")
    if options.publishes < 0:
        parser.error("--publishes must be >= 0")
    if not reachable(options.dsn):
        print(f"PostgreSQL: skipped (nothing listens on {address(options.dsn)})")
        return 0

    started = time.monotonic()
    sides = [] if options.only_fanout else list(SIDES)
    publishes = 0 if options.only_fanout else options.publishes

    Found = dict[int, list[Written]]
    Latency = tuple[dict[str, list[Latencies]], dict[str, str]]

    async def run_all() -> tuple[str, Result, Found, Latency]:
        server = await server_version(options.dsn)
        result = await measure(options.dsn, options.messages, options.rounds, sides)
        latencies: Latency = ({}, {})
        if publishes:
            try:
                latencies = await measure_latency(
                    options.dsn, publishes, options.rounds, redis_url=options.redis_url
                )
            except Exception as error:
                result.errors["latency"] = describe(error)
        found = (
            await measure_fanout(options.dsn, options.messages, options.rounds, fanouts)
            if fanouts
            else {}
        )
        return server, result, found, latencies

    server, result, found, latencies = anyio.run(
        run_all, backend="asyncio", backend_options={"use_uvloop": options.loop == "uvloop"}
    )
    lines = header(options.loop, server)
    if sides:
        lines += ["", *report(result, options.messages, options.rounds, options.dsn)]
    found_latencies, skipped_paths = latencies
    if found_latencies:
        lines += ["", *latency_report(found_latencies, skipped_paths, publishes)]
    elif "latency" in result.errors:
        lines += ["", f"Transactional publish latency: error: {result.errors['latency']}"]
    if found:
        lines += ["", *fanout_report(found, options.messages)]
    verdicts = judge(result) if options.check and sides else []
    if options.check and found_latencies:
        verdicts.append(latency_verdict(found_latencies, skipped_paths))
    if verdicts:
        lines += ["", "targets:"]
        lines += [f"  {v.verdict:<4}  {v.name:<46} {v.goal:<8} {v.measured}" for v in verdicts]
    lines.append(f"\ntotal time {time.monotonic() - started:.0f} s")
    print("\n".join(lines))
    broken = [
        f"{side}: {why}"
        for side, why in result.errors.items()
        if "asyncbus" in side or side == "latency"
    ]
    for failure in broken:
        print(f"asyncbus failed on PostgreSQL, {failure}", file=sys.stderr)
    failed = any(verdict.verdict == "FAIL" for verdict in verdicts)
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
