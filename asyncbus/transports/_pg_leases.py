"""``max_in_flight``'s slots in PostgreSQL: one row per stage in the transport's
``slots`` table, its leases a JSON object (``{holder: when it runs out}``, epoch
seconds on the database's clock).

Each step is one statement on that row (taking a slot is an ``INSERT ... ON CONFLICT
DO UPDATE``): the row is locked, the clock read, the leases run out dropped, and the
holder added when fewer than ``limit`` remain, so two processes never take the same
slot and the replicas' clocks do not matter. A process that dies holding a slot loses
it when its lease runs out. The upkeep deletes a row whose leases all ran out. See
:mod:`asyncbus._leases`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._exceptions import TransportError
from ._pg_common import row_key

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["PgLeaseStore"]


class PgLeaseStore:
    """A :class:`~asyncbus._leases.LeaseStore` in the transport's database.

    Made by :meth:`PostgresTransport.lease_store`; usable while the transport is connected.
    """

    def __init__(self, transport: PgHost) -> None:
        self._transport = transport

    async def acquire(self, name: str, limit: int, holder: str, lease: float) -> bool:
        """Take one of the ``limit`` slots of ``name`` for ``holder``: whether one was free."""
        transport = self._transport
        found = await transport.run(
            f"taking a slot of {name!r}",
            "fetchval",
            transport.sql.acquire_slot,
            row_key(name),
            limit,
            holder,
            lease,
        )
        if found not in (None, True, False):
            raise TransportError(f"PostgreSQL: unexpected slot reply {found!r}")
        return found is True

    async def renew(self, name: str, holders: list[str], lease: float) -> int:
        """Extend ``holders``' leases on ``name``: how many were still held."""
        transport = self._transport
        found = await transport.run(
            f"renewing slots of {name!r}",
            "fetchval",
            transport.sql.renew_slots,
            row_key(name),
            holders,
            lease,
        )
        return int(found or 0)

    async def release(self, name: str, holder: str) -> None:
        """Give ``holder``'s slot of ``name`` back."""
        transport = self._transport
        await transport.run(
            f"giving back a slot of {name!r}",
            "execute",
            transport.sql.release_slot,
            row_key(name),
            holder,
        )

    async def count(self, name: str) -> int:
        """How many leases of ``name`` have not run out."""
        transport = self._transport
        found = await transport.run(
            f"counting the leases of {name!r}", "fetchval", transport.sql.count_slots, row_key(name)
        )
        return int(found or 0)
