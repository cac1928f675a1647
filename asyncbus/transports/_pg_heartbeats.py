"""Each process's heartbeat in PostgreSQL (:class:`~asyncbus._cluster.Heartbeats`).

One row per process in the transport's ``heartbeats`` table: its instance id, its latest
record and when it was written (the database's clock). Only the rows written in the last
:data:`~asyncbus._cluster.FORGET_AFTER` seconds are read; the upkeep deletes older ones
(a process that died), so the table stays as small as the deployment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["PgHeartbeats"]


class PgHeartbeats:
    """The heartbeats of ``transport``'s schema."""

    def __init__(self, transport: PgHost) -> None:
        self._transport = transport

    async def beat(self, instance: str, record: bytes) -> None:
        """Write ``instance``'s record."""
        transport = self._transport
        await transport.run("writing a heartbeat", "execute", transport.sql.beat, instance, record)

    async def beats(self) -> list[bytes]:
        """Every record written in the last :data:`FORGET_AFTER` seconds."""
        transport = self._transport
        rows = await transport.run("reading the heartbeats", "fetch", transport.sql.beats)
        return [bytes(row[0]) for row in rows]

    async def forget(self, instance: str) -> None:
        """Delete ``instance``'s record."""
        transport = self._transport
        await transport.run("deleting a heartbeat", "execute", transport.sql.forget_beat, instance)
