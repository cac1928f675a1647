"""Where ``max_in_flight``'s slots are kept when every process of a group shares them.

A slot is a lease: taken for some seconds, renewed while its handler runs, given back
after, and free again once it runs out (its process died). Over a broker that offers
a :class:`LeaseStore` (``transport.lease_store()``: Redis, NATS, PostgreSQL) the leases
are kept there; see :mod:`asyncbus._flights` for how a stage uses them. The partitions
of an ordered group (:mod:`asyncbus._partitions`) are leases too (one slot each), and
their replicas count one another with a :class:`LeaseCounter`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["LeaseCounter", "LeaseStore", "PartitionLeases"]


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


@runtime_checkable
class LeaseCounter(Protocol):
    """A :class:`LeaseStore` that can also tell how many leases of a name are held."""

    async def count(self, name: str) -> int:
        """How many leases of ``name`` have not run out.

        :raises TransportError: the broker did not answer.
        """
        ...


@runtime_checkable
class PartitionLeases(Protocol):
    """Where the partitions of an ordered group are leased to its replicas, one each at
    a time (see :mod:`asyncbus._partitions`): a lease per partition, a count of the
    replicas (and of those short of their share), and a mark per partition that outlives
    its holder. Over Redis, NATS and PostgreSQL these are the broker's leases; over
    RabbitMQ, exclusive queues and consumer counts.

    Every method raises :class:`~asyncbus.TransportError` when the broker did not answer.
    """

    async def count_in(self, name: str, member: str) -> int:
        """Count ``member`` in under ``name`` (kept by calling again every round, or for
        as long as its connection lives): how many are counted in now."""
        ...

    async def count_out(self, name: str, member: str) -> None:
        """Count ``member`` out of ``name``."""
        ...

    async def count(self, name: str) -> int:
        """How many are counted in under ``name``."""
        ...

    async def take(self, name: str, member: str) -> bool:
        """Take the lease ``name`` for ``member``: whether it is ``member``'s now."""
        ...

    async def keep(self, name: str, member: str) -> bool:
        """Keep ``member``'s lease ``name`` (renewed): whether it was still held."""
        ...

    async def give(self, name: str, member: str) -> None:
        """Give ``member``'s lease ``name`` back."""
        ...

    async def mark(self, name: str) -> None:
        """Set the mark ``name``, which outlives the process that set it."""
        ...

    async def unmark(self, name: str) -> None:
        """Clear the mark ``name``."""
        ...

    async def marked(self, name: str) -> bool:
        """Whether the mark ``name`` is set."""
        ...
