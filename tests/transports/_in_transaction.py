"""Buses that publish in the caller's PostgreSQL transaction, for the tests of
``publish(connection=)``: over ``PostgresTransport`` (which writes its message rows in that
transaction) and over Redis with a ``PostgresOutbox`` (whose relay forwards the committed
rows), each in schemas and under a prefix of the test's own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from asyncbus import Bus
from asyncbus.transports.postgres import PostgresOutbox, PostgresTransport
from asyncbus.transports.redis import RedisTransport

__all__ = ["KINDS", "WAIT", "InTransaction", "Seen", "in_transaction", "until"]

#: The two ways a bus publishes in a transaction: the transport's rows, an outbox's.
KINDS = ("postgres", "redis")
#: A deadline for every wait of these tests (a regression fails, never hangs).
WAIT = 20.0


@dataclass
class InTransaction:
    """A bus that publishes in the caller's transaction, and where such a publish waits
    before its consumers can take it."""

    kind: str
    bus: Bus
    #: The bus's outbox (over Redis), else ``None``: the transport writes.
    outbox: PostgresOutbox | None

    async def waiting(self, topic: str, group: str) -> int:
        """Publishes made in a committed transaction that were not taken yet: the
        outbox's rows, or the transport's unsettled rows of (``topic``, ``group``)."""
        if self.outbox is not None:
            return await self.outbox.pending()
        transport = self.bus.transport
        assert isinstance(transport, PostgresTransport)
        return await transport.backlog(topic, group)

    async def settled(self, topic: str, group: str) -> None:
        """Wait until nothing published in a transaction waits (:meth:`waiting` is 0)."""

        async def empty() -> bool:
            return await self.waiting(topic, group) == 0

        await until(empty)


def in_transaction(request: pytest.FixtureRequest, kind: str, **bus_options: Any) -> InTransaction:
    """A bus of ``kind`` (see :data:`KINDS`) in schemas of the test's own (the fixture
    ``postgres_schemas``), over Redis under the test's prefix (``redis_prefix``)."""
    dsn: str = request.getfixturevalue("postgres_dsn")
    schemas: Callable[[str], str] = request.getfixturevalue("postgres_schemas")
    if kind == "postgres":
        transport = PostgresTransport(dsn, schema=schemas("bus"), poll_interval=0.2)
        return InTransaction(kind, Bus(transport, **bus_options), None)
    assert kind == "redis", kind
    outbox = PostgresOutbox(dsn, schema=schemas("outbox"), poll_interval=0.2)
    redis = RedisTransport(
        request.getfixturevalue("redis_url"), prefix=request.getfixturevalue("redis_prefix")
    )
    return InTransaction(kind, Bus(redis, outbox=outbox, **bus_options), outbox)


class Seen:
    """What a handler got, and a wait for a count of it."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._changed = anyio.Event()

    def add(self, item: Any) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    async def reach(self, count: int) -> None:
        with anyio.fail_after(WAIT):
            while len(self.items) < count:
                await self._changed.wait()


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Wait, within the deadline, until ``condition()`` holds."""
    with anyio.fail_after(WAIT):
        while not await condition():
            await anyio.sleep(0.02)
