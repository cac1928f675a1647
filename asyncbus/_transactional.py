"""Publishing inside the caller's database transaction: what ``publish(connection=)`` needs.

A :class:`TransactionalPublisher` writes envelopes through a database connection the
caller holds, inside the transaction the caller opened on it, so the envelopes exist if
and only if that transaction commits. Two things are one: a transport whose broker *is*
that database (``PostgresTransport`` writes its message rows), and an outbox given to
the bus (``Bus(outbox=PostgresOutbox(dsn))``), which writes a row that its relay
forwards to whatever transport the bus uses once the transaction has committed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ._envelope import Envelope

__all__ = ["TransactionalPublisher"]


@runtime_checkable
class TransactionalPublisher(Protocol):
    """Something that can write a publish inside the caller's open transaction."""

    async def publish_in(self, connection: Any, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Write ``envelopes`` (all on ``topic``) through ``connection``, inside the
        transaction the caller opened on it: they are published if and only if it commits.

        :raises ConfigurationError: when ``connection`` is not one this writer can use
            (another database client's, or one not inside a transaction).
        """
