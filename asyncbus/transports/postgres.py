"""PostgreSQL as the broker, and the outbox and inbox that commit with the caller's data."""

from __future__ import annotations

from ._pg_inbox import PostgresInbox, current_connection
from ._pg_outbox import PostgresOutbox

__all__ = ["PostgresInbox", "PostgresOutbox", "current_connection"]
