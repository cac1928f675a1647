"""The runs of ``python -m asyncbus bench postgres`` (see :mod:`._postgres`): one timed
run of asyncbus over ``PostgresTransport``, one of the hand-written asyncpg loop over
tables of the transport's design, and one publish-only run into a topic reaching a
number of groups (the rows and bytes a row per group costs). Each run makes a schema of
its own and drops it afterwards."""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from asyncbus import Batch, Bus
from asyncbus.transports.postgres import PostgresTransport

from ._brokers import publish_concurrently  # IN_FLIGHT (100) publishes at a time

DSN = "postgresql://postgres@127.0.0.1:5432/test?sslmode=disable"
TOPIC = "bench.items"
GROUP = "bench"
BATCH = 100
#: ``Batch``'s default ``max_wait``: what the reported lingering batch side waits.
LINGER = 0.05
CONCURRENCY = 8
CAPACITY = 256
#: Publisher tasks of the batch sides, each ``publish_many`` (or insert) of ``BATCH``.
PUBLISHERS = 4
#: Connections of the hand-written pool: the transport's default ``pool_size``.
POOL = 10
#: Groups the fan-out sides reach with each publish.
FANOUT = 3
WARM_UP = 500

Payload = dict[str, Any]


def payloads(count: int) -> list[Payload]:
    """The messages of a run, built before timing."""
    return [{"id": i, "kind": "order.created", "amount": 12.5} for i in range(count)]


@dataclass(frozen=True)
class Run:
    """One timed run: seconds from the first publish until the last ack, and this
    process's CPU time over wall time in that span."""

    seconds: float
    cpu: float


class Timer:
    """Wall and process CPU time of a timed span."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def stop(self) -> Run:
        wall = time.perf_counter() - self.wall
        return Run(wall, (time.process_time() - self.cpu) / max(wall, 1e-9))

    def __exit__(self, *exc: object) -> None:
        return None


class Counter:
    """The handler body of every side: count, and say when the last one came."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.handled = 0
        self.done = anyio.Event()

    def add(self, count: int = 1) -> None:
        self.handled += count
        if self.handled >= self.total:
            self.done.set()

    def check(self) -> None:
        if self.handled != self.total:
            raise RuntimeError(f"handled {self.handled} envelopes, expected {self.total}")


async def publish_chunks(chunks: Sequence[Sequence[Payload]], publish: Any) -> None:
    """Each chunk by ``publish(chunk)``, from ``PUBLISHERS`` tasks taking the next in turn."""
    next_chunk = 0

    async def publisher() -> None:
        nonlocal next_chunk
        while next_chunk < len(chunks):
            chunk = chunks[next_chunk]
            next_chunk += 1
            await publish(chunk)

    async with anyio.create_task_group() as task_group:
        for _ in range(min(PUBLISHERS, len(chunks))):
            task_group.start_soon(publisher)


def new_schema(tag: str) -> str:
    """A fresh schema name for one run."""
    return f"bench_pg_{tag}_{secrets.token_hex(4)}"


async def drop_schema(dsn: str, schema: str) -> None:
    """Drop a run's schema with everything in it (shielded: it runs after a failure too)."""
    import asyncpg

    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
        connection = await asyncpg.connect(dsn)
        try:
            await connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await connection.close()


# -- asyncbus ----------------------------------------------------------------------


def chunked(messages: Sequence[Payload]) -> list[Sequence[Payload]]:
    return [messages[start : start + BATCH] for start in range(0, len(messages), BATCH)]


async def asyncbus_run(
    dsn: str,
    messages: Sequence[Payload],
    *,
    groups: int = 1,
    batch: bool = False,
    linger: float = 0.0,
) -> Run:
    """One Bus over a fresh schema: ``groups`` subscriptions on the topic, single
    publishes from 100 tasks (or ``publish_many`` of 100 from 4, into batch handlers
    that wait up to ``linger`` seconds for a batch to fill: ``Batch.max_wait``)."""
    schema = new_schema("ab")
    transport = PostgresTransport(dsn, schema=schema)
    bus = Bus(transport=transport)
    names = [GROUP] if groups == 1 else [f"{GROUP}-{n}" for n in range(groups)]
    counter = Counter(len(messages) * groups)

    async def handle(payload: Payload) -> None:
        counter.add()

    async def handle_batch(batch: list[Payload]) -> None:
        counter.add(len(batch))

    for name in names:
        if batch:
            bus.subscribe(
                TOPIC,
                handle_batch,
                group=name,
                concurrency=CONCURRENCY,
                capacity=CAPACITY,
                batch=Batch(max_size=BATCH, max_wait=linger),
            )
        else:
            bus.subscribe(TOPIC, handle, group=name, concurrency=CONCURRENCY, capacity=CAPACITY)
    try:
        async with bus:
            with Timer() as timer:
                if batch:
                    publish_many = bus.publish_many
                    await publish_chunks(chunked(messages), lambda c: publish_many(TOPIC, c))
                else:
                    publish = bus.publish
                    await publish_concurrently(len(messages), lambda i: publish(TOPIC, messages[i]))
                await counter.done.wait()
                await bus.drain(timeout=60)  # every ack written
                run = timer.stop()
            for name in names:
                left = await transport.backlog(TOPIC, name)
                if left:
                    raise RuntimeError(f"{left} rows of group {name!r} left unsettled")
        counter.check()
        return run
    finally:
        await drop_schema(dsn, schema)


# -- hand-written asyncpg ------------------------------------------------------------


def hand_tables(s: str) -> list[str]:
    """The hand-written side's tables: the transport's design (groups routed by a regular
    expression, one messages row per group reached), its columns and its index."""
    return [
        f"CREATE SCHEMA {s}",
        f"""CREATE TABLE {s}.groups (
            id serial PRIMARY KEY, pattern text NOT NULL, grp text NOT NULL,
            regex text NOT NULL, UNIQUE (pattern, grp))""",
        f"""CREATE TABLE {s}.messages (
            seq bigserial PRIMARY KEY,
            group_id integer NOT NULL REFERENCES {s}.groups (id) ON DELETE CASCADE,
            envelope_id text NOT NULL,
            meta bytea NOT NULL,
            body bytea NOT NULL,
            attempt integer NOT NULL,
            deliveries integer NOT NULL DEFAULT 0,
            queued_at double precision NOT NULL DEFAULT extract(epoch FROM clock_timestamp()),
            available_at timestamptz NOT NULL DEFAULT now(),
            claimed_by text,
            claimed_until timestamptz)""",
        f"CREATE INDEX ON {s}.messages (group_id, seq)",
        f"CREATE INDEX ON {s}.messages (claimed_by) WHERE claimed_by IS NOT NULL",
    ]


class HandStatements:
    """The hand-written side's SQL for one schema."""

    def __init__(self, s: str) -> None:
        wake = f"pg_notify('{s}', group_id::text)"
        #: (topic, envelope id, meta, body): a row for every group reached, notified.
        self.insert = f"""
            WITH ins AS (
                INSERT INTO {s}.messages (group_id, envelope_id, meta, body, attempt)
                SELECT id, $2, $3, $4, 1 FROM {s}.groups WHERE $1 ~ regex
                RETURNING group_id
            )
            SELECT {wake} FROM (SELECT DISTINCT group_id FROM ins) d"""
        #: (topic, ids, metas, bodies): the same for a batch, in order.
        self.insert_many = f"""
            WITH ins AS (
                INSERT INTO {s}.messages (group_id, envelope_id, meta, body, attempt)
                SELECT g.id, e.id, e.meta, e.body, 1
                FROM {s}.groups g CROSS JOIN unnest($2::text[], $3::bytea[], $4::bytea[])
                    WITH ORDINALITY AS e(id, meta, body, n)
                WHERE $1 ~ g.regex ORDER BY g.id, e.n
                RETURNING group_id
            )
            SELECT {wake} FROM (SELECT DISTINCT group_id FROM ins) d"""
        #: (group id, consumer, ack timeout, most rows): the transport's claim.
        self.claim = f"""
            UPDATE {s}.messages m SET
                claimed_by = $2,
                claimed_until = now() + make_interval(secs => $3),
                deliveries = m.deliveries + 1
            FROM (
                SELECT seq FROM {s}.messages
                WHERE group_id = $1 AND available_at <= now()
                    AND (claimed_until IS NULL OR claimed_until < now())
                ORDER BY seq LIMIT $4 FOR UPDATE SKIP LOCKED
            ) c
            WHERE m.seq = c.seq
            RETURNING m.seq, m.body"""
        #: (seqs).
        self.delete = f"DELETE FROM {s}.messages WHERE seq = ANY($1::bigint[])"
        #: () -> rows left.
        self.left = f"SELECT count(*) FROM {s}.messages"


def hand_meta(envelope_id: str) -> bytes:
    """What the hand-written side stores beside the body: the id and the topic."""
    return json.dumps({"id": envelope_id, "topic": TOPIC}).encode()


async def hand_run(
    dsn: str, messages: Sequence[Payload], *, groups: int = 1, batch: bool = False
) -> Run:
    """Hand-written asyncpg over tables of the transport's design (see the module)."""
    import asyncpg

    schema = new_schema("hand")
    sql = HandStatements(schema)
    counter = Counter(len(messages) * groups)
    pool = await asyncpg.create_pool(dsn, min_size=POOL, max_size=POOL)
    listener = await asyncpg.connect(dsn)
    consumers: list[Any] = []
    try:
        async with pool.acquire() as connection:
            for statement in hand_tables(schema):
                await connection.execute(statement)
            names = [GROUP] if groups == 1 else [f"{GROUP}-{n}" for n in range(groups)]
            ids = [
                await connection.fetchval(
                    f"INSERT INTO {schema}.groups (pattern, grp, regex) VALUES ($1, $2, $3) "
                    "RETURNING id",
                    TOPIC,
                    name,
                    "^bench\\.items$",
                )
                for name in names
            ]
        events = {group_id: anyio.Event() for group_id in ids}
        consumers += [await asyncpg.connect(dsn) for _ in ids]  # one each, as by hand

        def heard(_connection: Any, _pid: int, _channel: str, payload: str) -> None:
            event = events.get(int(payload))
            if event is not None:
                event.set()
                events[int(payload)] = anyio.Event()

        await listener.add_listener(schema, heard)
        dumps = json.dumps

        async def publish(index: int) -> None:
            envelope_id = secrets.token_hex(16)
            body = dumps(messages[index]).encode()
            await pool.execute(sql.insert, TOPIC, envelope_id, hand_meta(envelope_id), body)

        async def publish_many(chunk: Sequence[Payload]) -> None:
            ids_ = [secrets.token_hex(16) for _ in chunk]
            await pool.execute(
                sql.insert_many,
                TOPIC,
                ids_,
                [hand_meta(envelope_id) for envelope_id in ids_],
                [dumps(payload).encode() for payload in chunk],
            )

        async def consume(group_id: int, connection: Any) -> None:
            # The event to wait on is looked up before each claim: a notification
            # replaces it, so one that comes during the claim is never lost.
            loads = json.loads
            consumer = f"hand-{secrets.token_hex(4)}"
            mine = 0  # each group's consumer stops once its group's rows are done
            while mine < len(messages):
                wake = events[group_id]
                rows = await connection.fetch(sql.claim, group_id, consumer, 30.0, BATCH)
                if not rows:
                    with anyio.move_on_after(1.0):
                        await wake.wait()
                    continue
                seqs = []
                for seq, body in rows:
                    loads(body)
                    seqs.append(seq)
                await connection.execute(sql.delete, seqs)
                mine += len(seqs)
                counter.add(len(seqs))

        with Timer() as timer:
            async with anyio.create_task_group() as task_group:
                for group_id, connection in zip(ids, consumers, strict=True):
                    task_group.start_soon(consume, group_id, connection)
                if batch:
                    await publish_chunks(chunked(messages), publish_many)
                else:
                    await publish_concurrently(len(messages), publish)
                await counter.done.wait()
            run = timer.stop()
        counter.check()
        left = await pool.fetchval(sql.left)
        if left:
            raise RuntimeError(f"{left} rows left in the messages table")
        return run
    finally:
        with anyio.CancelScope(shield=True):
            for connection in (listener, *consumers):
                await connection.close()
            await pool.close()
        await drop_schema(dsn, schema)


# -- fan-out: what a row per group costs a publish ---------------------------------------


@dataclass(frozen=True)
class Written:
    """One publish-only run into a topic reaching ``groups`` groups."""

    groups: int
    seconds: float
    rows: int
    table_bytes: int  # growth of messages: heap, indexes and TOAST
    wal_bytes: int  # growth of the server's write-ahead log (every database's writes)
    row_bytes: float  # average meta + body of a row


async def fanout_run(dsn: str, messages: Sequence[Payload], groups: int) -> Written:
    """Register ``groups`` groups (subscriptions that never read), then publish
    ``messages`` from 100 tasks; the rows and bytes that took."""
    import asyncpg

    schema = new_schema("fan")
    transport = PostgresTransport(dsn, schema=schema)
    bus = Bus(transport=transport)
    probe = await asyncpg.connect(dsn)
    size = f"SELECT pg_total_relation_size('{schema}.messages')"
    try:
        async with bus, contextlib.AsyncExitStack() as stack:
            for n in range(groups):
                await stack.enter_async_context(
                    transport.subscribe(TOPIC, group=f"{GROUP}-{n}", prefetch=1)
                )
            before = await probe.fetchval(size)
            wal = await probe.fetchval("SELECT pg_current_wal_insert_lsn()::text")
            publish = bus.publish
            with Timer() as timer:
                await publish_concurrently(len(messages), lambda i: publish(TOPIC, messages[i]))
                run = timer.stop()
            wal_bytes = await probe.fetchval(
                "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::text::pg_lsn)::bigint", wal
            )
            after = await probe.fetchval(size)
            rows, row_bytes = await probe.fetchrow(
                f"SELECT count(*), avg(length(meta) + length(body)) FROM {schema}.messages"
            )
        return Written(
            groups, run.seconds, int(rows), after - before, int(wal_bytes), float(row_bytes)
        )
    finally:
        with anyio.CancelScope(shield=True):
            await probe.close()
        await drop_schema(dsn, schema)
