"""``deduplicate()``'s store in PostgreSQL: one row per key in the transport's ``claims``
table, claimed with a lease, kept as done for the window (owner ``''``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._dedup import Claim

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["PgDedupStore"]


class PgDedupStore:
    """A :class:`~asyncbus._dedup.DedupStore` shared by every process using the database."""

    def __init__(self, transport: PgHost) -> None:
        self._transport = transport

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """Claim ``key`` for ``owner`` for ``lease`` seconds, unless done or claimed."""
        transport = self._transport
        found = await transport.run(
            f"claiming {key!r}", "fetchval", transport.sql.claim_key, key, owner, lease
        )
        return Claim(found)

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep ``owner``'s claim ``lease`` more seconds; ``False`` if it is not held."""
        transport = self._transport
        status = await transport.run(
            f"extending {key!r}", "execute", transport.sql.extend_key, key, owner, lease
        )
        return str(status).endswith(" 1")

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Remember ``key`` as handled for ``ttl`` seconds."""
        transport = self._transport
        await transport.run(f"marking {key!r} done", "execute", transport.sql.done_key, key, ttl)

    async def release(self, key: str, owner: str) -> None:
        """Forget ``owner``'s claim of ``key``."""
        transport = self._transport
        await transport.run(f"releasing {key!r}", "execute", transport.sql.release_key, key, owner)
