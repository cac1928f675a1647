"""``publish(connection=)`` from SQLAlchemy's asyncio engine: the asyncpg connection under
SQLAlchemy's (``(await conn.get_raw_connection()).driver_connection``) takes the publish
into the transaction SQLAlchemy opened, so a Core or ORM write and the publish commit
together, or roll back together. Over ``PostgresTransport`` and over Redis with a
``PostgresOutbox``, against the local PostgreSQL server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

# The test extra's sqlalchemy[asyncio], left out on free-threaded 3.13t (see .ci/run).
pytest.importorskip("sqlalchemy", reason="SQLAlchemy is not installed on this interpreter")
pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio engine needs greenlet")

import sqlalchemy as sa
from _in_transaction import KINDS, InTransaction, Seen, in_transaction
from sqlalchemy.ext.asyncio import (
    AsyncConnection,
    AsyncEngine,
    AsyncSession,
    create_async_engine,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from asyncbus import ConfigurationError, Envelope

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Abort(Exception):
    """The caller's work failed: its transaction rolls back."""


@pytest.fixture(params=KINDS)
def made(request: pytest.FixtureRequest) -> InTransaction:
    """A bus over PostgresTransport, or over Redis with an outbox."""
    return in_transaction(request, request.param)


@pytest.fixture
def schema(postgres_schemas: Callable[[str], str]) -> str:
    """The schema of the test's ``orders`` table (dropped after the test)."""
    return postgres_schemas("orders")


@pytest.fixture
async def engine(postgres_dsn: str, schema: str) -> AsyncIterator[AsyncEngine]:
    """SQLAlchemy's asyncio engine on the local database, its tables in ``schema``."""
    made = create_async_engine(
        postgres_dsn.replace("postgresql://", "postgresql+asyncpg://", 1),
        execution_options={"schema_translate_map": {None: schema}},
    )
    try:
        async with made.begin() as connection:
            await connection.execute(sa.text(f"CREATE SCHEMA {schema}"))
            await connection.run_sync(Base.metadata.create_all)
        yield made
    finally:
        await made.dispose()


class Base(DeclarativeBase):
    """The test's ORM models."""


class Order(Base):
    """An order row, written through the ORM or Core (in the engine's schema)."""

    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    total: Mapped[int]


async def asyncpg_connection(connection: AsyncConnection) -> Any:
    """The asyncpg connection under SQLAlchemy's (the guide's way)."""
    return (await connection.get_raw_connection()).driver_connection


async def order_ids(engine: AsyncEngine) -> list[int]:
    async with engine.connect() as connection:
        found = await connection.execute(sa.select(Order.id).order_by(Order.id))
        return list(found.scalars())


def audited(made: InTransaction, seen: Seen) -> None:
    @made.bus.subscribe("orders.created", group="audit")
    async def audit(envelope: Envelope) -> None:
        seen.add((envelope.id, envelope.payload))


async def test_a_core_write_and_the_publish_commit_together_or_roll_back_together(
    made: InTransaction, engine: AsyncEngine
) -> None:
    seen = Seen()
    audited(made, seen)
    async with made.bus:
        with pytest.raises(Abort):
            async with engine.begin() as connection:
                await connection.execute(sa.insert(Order).values(id=1, total=10))
                raw = await asyncpg_connection(connection)
                await made.bus.publish("orders.created", {"id": 1}, connection=raw)
                raise Abort
        assert await made.waiting("orders.created", "audit") == 0
        async with engine.begin() as connection:
            await connection.execute(sa.insert(Order).values(id=2, total=20))
            raw = await asyncpg_connection(connection)
            receipt = await made.bus.publish("orders.created", {"id": 2}, connection=raw)
            assert await made.waiting("orders.created", "audit") == 0  # (not committed)
        await seen.reach(1)
        await made.settled("orders.created", "audit")
        await made.bus.drain()
    assert seen.items == [(receipt.id, {"id": 2})]
    assert await order_ids(engine) == [2]


async def test_an_orm_session_flush_and_the_publish_commit_together_or_roll_back_together(
    made: InTransaction, engine: AsyncEngine
) -> None:
    seen = Seen()
    audited(made, seen)

    async def place(order: Order, fail: bool) -> str:
        async with AsyncSession(engine) as session, session.begin():
            session.add(order)
            await session.flush()  # (the ORM's INSERT: it begins the database's transaction)
            raw = await asyncpg_connection(await session.connection())
            receipt = await made.bus.publish("orders.created", {"id": order.id}, connection=raw)
            if fail:
                raise Abort
        return receipt.id

    async with made.bus:
        with pytest.raises(Abort):
            await place(Order(id=3, total=30), fail=True)
        kept = [await place(Order(id=n, total=n * 10), fail=False) for n in (4, 5)]
        await seen.reach(2)
        await made.settled("orders.created", "audit")
        await made.bus.drain()
    assert seen.items == [(kept[0], {"id": 4}), (kept[1], {"id": 5})]
    assert await order_ids(engine) == [4, 5]


async def test_a_publish_before_the_first_statement_is_refused_and_writes_nothing(
    made: InTransaction, engine: AsyncEngine
) -> None:
    """SQLAlchemy begins the database's transaction at its first statement: before it,
    the asyncpg connection is outside any, and the publish says so."""
    seen = Seen()
    audited(made, seen)
    async with made.bus:
        async with engine.begin() as connection:
            raw = await asyncpg_connection(connection)
            with pytest.raises(ConfigurationError, match="first statement"):
                await made.bus.publish("orders.created", {"id": 6}, connection=raw)
            await connection.execute(sa.insert(Order).values(id=6, total=60))
            receipt = await made.bus.publish("orders.created", {"id": 6}, connection=raw)
        await seen.reach(1)
        await made.settled("orders.created", "audit")
        await made.bus.drain()
    assert seen.items == [(receipt.id, {"id": 6})]
    assert await order_ids(engine) == [6]
