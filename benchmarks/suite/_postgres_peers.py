"""The peers of ``python -m asyncbus bench postgres`` (see :mod:`._postgres`): the
PostgreSQL-backed job queues a user would pick instead of asyncbus over
``PostgresTransport``, doing the asyncbus side's work: ``--messages`` jobs enqueued by
``IN_FLIGHT`` (100) concurrent producers, consumed in the same process by one worker
task, each job a handler that decodes its payload and counts, timed from the first
enqueue until every job was handled *and* its completion written (no job left to do).

* **pgqueuer**: its tables installed by ``Queries.install()`` into a schema of the run's
  own (``DBSettings(db_schema=..., channel=...)``, so its notification channel is the
  run's too); producers ``await queries.enqueue("noop", payload_bytes)`` over an asyncpg
  pool of ``POOL`` (10) connections; one ``QueueManager.run()`` on a pool of its own
  (``WORKER_POOL``), its defaults otherwise: ``batch_size=10``, every fetched job a task
  of its own (no per-entrypoint ``concurrency_limit``: a limit frees its slots only when
  the job log buffer flushes, every 0.1 s, which holds 8 slots to ~80 jobs/s), completions
  logged in batches. Done when its queue table is empty (its log holds N successes).
* **procrastinate**: its schema applied by ``SchemaManager.apply_schema_async()`` in a
  schema of the run's own (the connections' ``search_path``; its SQL names are
  unqualified); producers ``await task.defer_async(**payload)`` through an ``App`` on a
  ``PsycopgConnector`` pool of ``POOL``; one worker, ``run_worker_async(concurrency=8,
  delete_jobs="always")``, from an ``App`` with a pool of its own (as a worker process
  has). Done when its jobs table is empty (a finished job is deleted, as asyncbus deletes
  an acked row). Its notification channels are database-wide
  (``procrastinate_any_queue_v1``): runs here are one at a time.

Each peer's package is imported only when its run starts; :func:`missing` says which
are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import secrets
from collections.abc import Sequence
from typing import Any

import anyio

from ._brokers import publish_concurrently
from ._postgres_runs import (
    CONCURRENCY,
    POOL,
    Counter,
    Payload,
    Run,
    Timer,
    drop_schema,
)

__all__ = ["PEERS", "missing", "peer_run"]

#: The peers, in the order each round runs them: name -> the package to import.
PEERS = {"pgqueuer": "pgqueuer", "procrastinate": "procrastinate"}
#: Connections of a peer worker's own pool.
WORKER_POOL = 4
#: Seconds between two looks at a peer's table once every job was handled (until its
#: completions are written).
POLL = 0.002
ENTRYPOINT = "noop"


def missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (its package is not installed), or ``None``."""
    if importlib.util.find_spec(PEERS[peer]) is None:
        return f"{PEERS[peer]} is not installed (pip install -e '.[bench]')"
    return None


async def peer_run(peer: str, dsn: str, messages: Sequence[Payload]) -> Run:
    """One timed run of ``peer`` over a fresh schema, dropped afterwards."""
    if peer == "pgqueuer":
        return await pgqueuer_run(dsn, messages)
    if peer == "procrastinate":
        return await procrastinate_run(dsn, messages)
    raise ValueError(f"unknown peer {peer!r}")


def _schema(tag: str) -> str:
    return f"bench_pg_{tag}_{secrets.token_hex(4)}"


async def _wait_empty(connection: Any, table: str) -> None:
    """Until ``table`` has no row left (the peer wrote every completion)."""
    while await connection.fetchval(f"SELECT count(*) FROM {table}"):
        await anyio.sleep(POLL)


# -- pgqueuer --------------------------------------------------------------------------


async def pgqueuer_run(dsn: str, messages: Sequence[Payload]) -> Run:
    """pgqueuer over asyncpg: 100 producers ``enqueue``, one ``QueueManager`` consumes."""
    import asyncpg
    from pgqueuer import AsyncpgDriver, AsyncpgPoolDriver, Queries, QueueManager
    from pgqueuer.adapters.persistence import qb
    from pgqueuer.domain.settings import DBSettings

    schema = _schema("pgq")
    settings = DBSettings(db_schema=schema, channel=schema)

    def queries(driver: Any) -> Any:
        return Queries(
            driver,
            qbe=qb.QueryBuilderEnvironment(settings),
            qbq=qb.QueryQueueBuilder(settings),
            qbs=qb.QuerySchedulerBuilder(settings),
        )

    counter = Counter(len(messages))
    probe = await asyncpg.connect(dsn)
    pools: list[Any] = []
    try:
        await queries(AsyncpgDriver(probe)).install()
        pools.append(await asyncpg.create_pool(dsn, min_size=POOL, max_size=POOL))
        pools.append(await asyncpg.create_pool(dsn, min_size=WORKER_POOL, max_size=WORKER_POOL))
        producer = queries(AsyncpgPoolDriver(pools[0]))
        manager = QueueManager(queries(AsyncpgPoolDriver(pools[1])), channel=settings.channel)
        loads, dumps = json.loads, json.dumps

        @manager.entrypoint(ENTRYPOINT)
        async def noop(job: Any) -> None:
            loads(job.payload)
            counter.add()

        async def enqueue(index: int) -> None:
            await producer.enqueue(ENTRYPOINT, dumps(messages[index]).encode())

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(manager.run)
            await _until_listening(probe, settings.channel)
            with Timer() as timer:
                await publish_concurrently(len(messages), enqueue)
                await counter.done.wait()
                await _wait_empty(probe, f"{schema}.{settings.queue_table}")
                run = timer.stop()
            manager.shutdown.set()
        counter.check()
        done = await probe.fetchval(
            f"SELECT count(*) FROM {schema}.{settings.queue_table_log} WHERE status = 'successful'"
        )
        if done != len(messages):
            raise RuntimeError(f"pgqueuer logged {done} successes, expected {len(messages)}")
        return run
    finally:
        with anyio.CancelScope(shield=True):
            for pool in pools:
                await pool.close()
            await probe.close()
        await drop_schema(dsn, schema)


async def _until_listening(connection: Any, channel: str) -> None:
    """Until a session of the database listens on ``channel`` (the worker is ready, its
    last statement its ``LISTEN``), at most 10 s."""
    with anyio.fail_after(10):
        while not await connection.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND query ILIKE $1",
            f"LISTEN%{channel}%",
        ):
            await anyio.sleep(0.01)


# -- procrastinate ---------------------------------------------------------------------


async def procrastinate_run(dsn: str, messages: Sequence[Payload]) -> Run:
    """procrastinate over psycopg: 100 producers ``defer_async``, one worker consumes."""
    import asyncpg
    from procrastinate import App, PsycopgConnector

    schema = _schema("proc")
    counter = Counter(len(messages))
    # libpq takes a DSN's options as a connection parameter: the run's schema first.
    settings = {"kwargs": {"options": f"-c search_path={schema}"}}
    producers = App(
        connector=PsycopgConnector(conninfo=dsn, min_size=POOL, max_size=POOL, **settings)
    )
    workers = App(
        connector=PsycopgConnector(
            conninfo=dsn, min_size=WORKER_POOL, max_size=WORKER_POOL, **settings
        )
    )

    async def noop(**payload: Any) -> None:
        counter.add()

    task = producers.task(name=ENTRYPOINT)(noop)
    workers.task(name=ENTRYPOINT)(noop)
    probe = await asyncpg.connect(dsn)
    try:
        await probe.execute(f"CREATE SCHEMA {schema}")
        async with producers.open_async(), workers.open_async():
            await producers.schema_manager.apply_schema_async()
            defer = task.defer_async

            async def enqueue(index: int) -> None:
                await defer(**messages[index])

            async with anyio.create_task_group() as task_group:
                task_group.start_soon(_procrastinate_worker, workers)
                await _until_worker(probe, schema)
                with Timer() as timer:
                    await publish_concurrently(len(messages), enqueue)
                    await counter.done.wait()
                    await _wait_empty(probe, f"{schema}.procrastinate_jobs")
                    run = timer.stop()
                task_group.cancel_scope.cancel()
        counter.check()
        return run
    finally:
        with anyio.CancelScope(shield=True):
            await probe.close()
        await drop_schema(dsn, schema)


async def _procrastinate_worker(app: Any) -> None:
    await app.run_worker_async(
        concurrency=CONCURRENCY,
        install_signal_handlers=False,
        delete_jobs="always",
        name="bench",
    )


async def _until_worker(connection: Any, schema: str) -> None:
    """Until the worker registered itself (it listens from then on), at most 10 s."""
    with anyio.fail_after(10):
        while not await connection.fetchval(f"SELECT count(*) FROM {schema}.procrastinate_workers"):
            await anyio.sleep(0.01)
