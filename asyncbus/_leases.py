"""Where ``max_in_flight``'s slots are kept when every process of a group shares them.

A slot is a lease: taken for some seconds, renewed while its handler runs, given back
after, and free again once it runs out (its process died). Over a broker that offers
a :class:`LeaseStore` (``transport.lease_store()``: Redis, NATS, PostgreSQL) the leases
are kept there; see :mod:`asyncbus._flights` for how a stage uses them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["LeaseStore"]


@runtime_checkable
class LeaseStore(Protocol):
    """Slots of a group kept in a broker as leases, shared by every process using it."""

    async def acquire(self, name: str, limit: int, holder: str, lease: float) -> bool:
        """Take one of the ``limit`` slots of ``name`` for ``holder`` for ``lease``
        seconds: whether one was free (leases run out are free).

        :raises TransportError: the broker did not answer.
        """
        ...

    async def renew(self, name: str, holders: list[str], lease: float) -> int:
        """Extend the leases of ``holders`` on ``name`` by ``lease`` seconds from now:
        how many were still held.

        :raises TransportError: the broker did not answer.
        """
        ...

    async def release(self, name: str, holder: str) -> None:
        """Give ``holder``'s slot of ``name`` back.

        :raises TransportError: the broker did not answer.
        """
        ...
