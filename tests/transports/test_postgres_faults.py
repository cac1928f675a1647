"""PostgreSQL's guarantees under faults, each counted exactly: a process killed between
its transaction's commit and the outbox relay, one killed between a handler's commit
(the inbox) and its ack, an envelope over the size limit, a DSN without a database.

The killed processes are the test's own (a script run with the venv's Python); every
table lives in a schema of the test's own, dropped afterwards. (The server's own faults,
a restart and a cut connection, are in the broker table's chaos and partition tests,
which run on a private server.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from asyncbus import Bus, ConfigurationError, ConnectError, Envelope, TransportError
from asyncbus.middleware import deduplicate
from asyncbus.transports.postgres import (
    PostgresInbox,
    PostgresOutbox,
    PostgresTransport,
    current_connection,
)
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.backends("asyncio"), pytest.mark.timeout(90)]


@pytest.fixture
def schemas(postgres_schemas: Callable[[str], str]) -> Callable[[str], str]:
    """Schema names of the test's own (``schemas("bus")``), dropped afterwards."""
    return postgres_schemas


def _script(tmp_path: Path, code: str) -> subprocess.Popen[str]:
    path = tmp_path / "victim.py"
    path.write_text(textwrap.dedent(code))
    return subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


async def _lines_until(process: subprocess.Popen[str], count: int, timeout: float) -> list[str]:
    """The first ``count`` lines the process prints (read in a thread)."""
    assert process.stdout is not None

    def read() -> list[str]:
        lines = []
        while len(lines) < count:
            line = process.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            lines.append(line.strip())
        return lines

    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(read)


def _kill(process: subprocess.Popen[str]) -> str:
    """SIGKILL the process (its own group), reap it; what it wrote on stderr."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    _, err = process.communicate(timeout=30)
    return err


async def test_a_process_killed_after_its_commits_loses_none_of_them_to_the_relay(
    tmp_path: Path,
    postgres_dsn: str,
    redis_url: str,
    redis_prefix: str,
    schemas: Callable[[str], str],
) -> None:
    """The publisher commits 100 orders (each with its message, through the outbox) and is
    killed mid-way: a bus started afterwards relays every committed one; each is handled
    once (the ids the dead relay may have sent already are dropped by deduplicate())."""
    outbox = schemas("outbox")
    # The group exists before anything is relayed (the victim's relay sends some).
    async with (
        RedisTransport(redis_url, prefix=redis_prefix) as transport,
        transport.subscribe("orders", group="fulfil", prefetch=1),
    ):
        pass
    victim = _script(
        tmp_path,
        f"""
        import anyio, asyncpg
        from asyncbus import Bus
        from asyncbus.transports.postgres import PostgresOutbox
        from asyncbus.transports.redis import RedisTransport

        async def main():
            bus = Bus(
                transport=RedisTransport({redis_url!r}, prefix={redis_prefix!r}),
                outbox=PostgresOutbox({postgres_dsn!r}, schema={outbox!r}),
            )
            connection = await asyncpg.connect({postgres_dsn!r})
            async with bus:
                print("ready", flush=True)
                for n in range(100):
                    async with connection.transaction():
                        receipt = await bus.publish("orders", n, connection=connection)
                    print(receipt.id, flush=True)
                await anyio.sleep_forever()

        anyio.run(main)
        """,
    )
    handled: list[int] = []
    relay = PostgresOutbox(postgres_dsn, schema=outbox, poll_interval=0.2)
    bus = Bus(
        transport=RedisTransport(redis_url, prefix=redis_prefix),
        outbox=relay,
        middleware=[deduplicate()],
    )

    @bus.subscribe("orders", group="fulfil")
    async def fulfil(n: int) -> None:
        handled.append(n)

    try:
        lines = await _lines_until(victim, 41, 60)
        assert lines[0] == "ready", lines
    finally:
        errors = _kill(victim)
    committed = lines[1:]
    assert len(committed) == 40, errors
    with anyio.fail_after(60):
        async with bus:
            while await relay.pending():
                await anyio.sleep(0.05)
            await bus.drain(30)
            stats = bus.statistics().stage("orders@fulfil")
    # Every committed order handled once; at most the one whose commit the kill hid
    # (committed but not printed) beside them; nothing twice.
    assert sorted(handled)[:40] == list(range(40))
    assert len(handled) in (40, 41)
    assert len(set(handled)) == len(handled)
    assert stats.dead_lettered == 0


async def test_a_handler_whose_commit_happened_is_not_run_again_after_its_process_dies(
    tmp_path: Path, postgres_dsn: str, schemas: Callable[[str], str]
) -> None:
    """The consumer commits the handler's write with the inbox's claim, then is killed
    before it acks: the envelope comes back to another process, which skips it; every
    effect is in the table once."""
    bus_schema, inbox_schema = schemas("bus"), schemas("inbox")
    import asyncpg

    setup = await asyncpg.connect(postgres_dsn)
    try:
        await setup.execute(f"CREATE TABLE {inbox_schema}_effects (n int NOT NULL)")
    finally:
        await setup.close()
    effects = f"{inbox_schema}_effects"
    async with PostgresTransport(postgres_dsn, schema=bus_schema) as transport:
        await transport.subscribe("work", group="effects", prefetch=1).__aenter__()
    publisher = Bus(transport=PostgresTransport(postgres_dsn, schema=bus_schema))
    async with publisher:
        for n in range(5):
            await publisher.publish("work", n)
    victim = _script(
        tmp_path,
        f"""
        import os, signal, anyio
        from asyncbus import Bus, middleware
        from asyncbus.transports.postgres import PostgresInbox, PostgresTransport
        from asyncbus.transports.postgres import current_connection

        @middleware
        async def die_after_commit(envelope, call_next):
            result = await call_next(envelope)
            if envelope.payload == 2:  # committed: killed before the ack
                print("committed 2", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        bus = Bus(transport=PostgresTransport({postgres_dsn!r}, schema={bus_schema!r},
                                              ack_timeout=1.0))

        @bus.subscribe("work", group="effects", concurrency=1, capacity=1, middleware=[
            die_after_commit, PostgresInbox({postgres_dsn!r}, schema={inbox_schema!r})])
        async def effect(n: int) -> None:
            await current_connection().execute("INSERT INTO {effects} VALUES ($1)", n)
            print("did", n, flush=True)

        async def main():
            async with bus:
                await anyio.sleep_forever()

        anyio.run(main)
        """,
    )
    try:
        lines = await _lines_until(victim, 10, 60)
        with anyio.fail_after(30):
            while victim.poll() is None:
                await anyio.sleep(0.05)
    finally:
        errors = _kill(victim)
    assert lines[-1:] == ["committed 2"], (lines, errors)
    assert victim.returncode == -signal.SIGKILL
    async with PostgresTransport(postgres_dsn, schema=bus_schema) as transport:
        # 2, 3 and 4, and any of 0 and 1 whose ack (written behind) the kill cut off.
        left = await transport.backlog("work", "effects")
    assert 3 <= left <= 5
    ran: list[int] = []
    survivor = Bus(transport=PostgresTransport(postgres_dsn, schema=bus_schema, ack_timeout=1.0))

    @survivor.subscribe(
        "work",
        group="effects",
        middleware=[PostgresInbox(postgres_dsn, schema=inbox_schema)],
    )
    async def effect(n: int) -> None:
        ran.append(n)
        await current_connection().execute(f"INSERT INTO {effects} VALUES ($1)", n)

    with anyio.fail_after(60):
        async with survivor:
            await survivor.drain(30)
            stats = survivor.statistics().stage("work@effects")
    check = await asyncpg.connect(postgres_dsn)
    try:
        rows = [row[0] for row in await check.fetch(f"SELECT n FROM {effects} ORDER BY n")]
        await check.execute(f"DROP TABLE {effects}")
    finally:
        await check.close()
    assert rows == [0, 1, 2, 3, 4]  # each effect once: 2 was not redone
    assert sorted(ran) == [3, 4]
    # The survivor received what was left: 2 and any of 0 and 1 again (each skipped: its
    # claim was committed), 3 and 4 (handled); it acked them all.
    assert (stats.published, stats.acked, stats.dead_lettered) == (left, left, 0)


async def test_an_envelope_over_the_size_limit_is_refused_and_nothing_of_its_batch_is_written(
    postgres_dsn: str, schemas: Callable[[str], str]
) -> None:
    async with (
        PostgresTransport(postgres_dsn, schema=schemas("bus"), max_message_size=1024) as transport,
        transport.subscribe("big", group="g", prefetch=5),
    ):
        small, large = (
            Envelope(topic="big", payload="x"),
            Envelope(topic="big", payload="y" * 2000),
        )
        with pytest.raises(TransportError, match="max_message_size=1024"):
            await transport.publish("big", [small, large])
        assert await transport.backlog("big", "g") == 0
        await transport.publish("big", [small])
        assert await transport.backlog("big", "g") == 1


def test_a_dsn_without_a_database_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="names no database"):
        PostgresTransport("postgresql://postgres@127.0.0.1:5432")
    with pytest.raises(ConfigurationError, match="names no database"):
        PostgresOutbox("postgresql://postgres@127.0.0.1:5432/")


async def test_a_database_that_does_not_exist_fails_the_start_naming_it(
    postgres_dsn: str,
) -> None:
    dsn = postgres_dsn.rsplit("/", 1)[0] + "/no_such_database"
    with pytest.raises(ConnectError, match="no_such_database"):
        async with Bus(transport=PostgresTransport(dsn)):
            pass
