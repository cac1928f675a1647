"""The NATS store of ``max_in_flight``'s slots: a JetStream key-value bucket, one key
per stage holding its leases (``{holder: when it runs out}``, JSON).

Every change is read, made and written back at the revision read (``update`` with
``last=``; ``create`` for a new key), again when another process moved first, so two
processes never take the same slot. Leases are timed on this machine's clock: keep the
clocks of a group's machines in sync (a skew lengthens or shortens a dead process's
leases by as much). See :mod:`asyncbus._leases`.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._nats_kv import KvBucket, NatsHost, change_at_revision

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ["NatsLeaseStore"]

#: Seconds a stage's key is kept after its last write.
_KEPT = 86_400.0

Leases = dict[str, float]


def _leases(value: bytes | None, now: float) -> Leases:
    """The leases still held in a key's value; none for a value this store did not write."""
    try:
        found = json.loads(value or b"{}")
    except ValueError:
        return {}
    if not isinstance(found, dict):
        return {}
    return {
        holder: until
        for holder, until in found.items()
        if isinstance(until, int | float) and math.isfinite(until) and until > now
    }


class NatsLeaseStore:
    """A :class:`~asyncbus._leases.LeaseStore` in a JetStream KV bucket.

    Made by :meth:`NatsTransport.lease_store`; the bucket is created at first use.
    """

    def __init__(self, transport: NatsHost) -> None:
        self.bucket = f"{transport.stream}_SLOTS"
        self._kv = KvBucket(
            transport, self.bucket, ttl=_KEPT, description="asyncbus max_in_flight slots"
        )

    async def _change(self, name: str, change: Callable[[Leases, float], int], doing: str) -> int:
        """Apply ``change`` (it edits the leases in place, returns the answer) to the
        leases of ``name``, at the revision read."""
        key = hashlib.sha256(name.encode()).hexdigest()[:40]

        def changed(value: bytes | None) -> tuple[bytes | None, int]:
            now = time.time()
            leases = _leases(value, now)
            before = dict(leases)
            answer = change(leases, now)
            if leases == before and value is not None:
                return None, answer  # nothing to write
            return json.dumps(leases).encode(), answer

        async def attempt(kv: KeyValue) -> int:
            return await change_at_revision(kv, key, changed, doing)

        return await self._kv.call_or_fail(attempt, doing)

    async def acquire(self, name: str, limit: int, holder: str, lease: float) -> bool:
        """Take one of the ``limit`` slots of ``name`` for ``holder``: whether one was free."""

        def take(leases: Leases, now: float) -> int:
            if holder not in leases and len(leases) >= limit:
                return 0
            leases[holder] = now + lease
            return 1

        return bool(await self._change(name, take, f"taking a slot of {name!r}"))

    async def renew(self, name: str, holders: list[str], lease: float) -> int:
        """Extend ``holders``' leases on ``name``: how many were still held."""

        def renew(leases: Leases, now: float) -> int:
            kept = [holder for holder in holders if holder in leases]
            for holder in kept:
                leases[holder] = now + lease
            return len(kept)

        return await self._change(name, renew, f"renewing slots of {name!r}")

    async def release(self, name: str, holder: str) -> None:
        """Give ``holder``'s slot of ``name`` back."""

        def release(leases: Leases, now: float) -> int:
            return 1 if leases.pop(holder, None) is not None else 0

        await self._change(name, release, f"giving back a slot of {name!r}")

    async def count(self, name: str) -> int:
        """How many leases of ``name`` have not run out."""

        def count(leases: Leases, now: float) -> int:
            return len(leases)

        return await self._change(name, count, f"counting the leases of {name!r}")
