"""``RateLimit``'s shared turns in PostgreSQL: one row per bucket in the transport's
``rates`` table, holding its TAT (epoch seconds, the database's clock).

A turn is one statement (an ``INSERT ... ON CONFLICT DO UPDATE``): the bucket's row is
locked, the clock read, the turn computed and the TAT moved, so two processes never
take the same turn, and callers that meet on one bucket are given their turns in the
order they reached its lock. The replicas' clocks do not matter. The upkeep deletes a
row once its bucket is full again (nothing owed), so idle buckets cost nothing. See
:mod:`asyncbus._rates`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .._exceptions import TransportError
from ._pg_common import row_key

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["PgRateStore"]


class PgRateStore:
    """A :class:`~asyncbus._rates.RateStore` in the transport's database.

    Made by :meth:`PostgresTransport.rate_store`; usable while the transport is connected.
    """

    def __init__(self, transport: PgHost) -> None:
        self._transport = transport

    async def take(self, key: str, interval: float, burst: int) -> float:
        """Take the next turn of bucket ``key``: seconds until it is due."""
        transport = self._transport
        found = await transport.run(
            f"taking a turn of rate limit {key!r}",
            "fetchval",
            transport.sql.take_turn,
            row_key(key),
            interval,
            burst,
        )
        if not isinstance(found, float) or not math.isfinite(found):
            raise TransportError(f"PostgreSQL: unexpected rate limit reply {found!r}")
        return found if found > 0 else 0.0
