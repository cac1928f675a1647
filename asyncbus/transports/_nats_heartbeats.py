"""Each process's heartbeat in a NATS key-value bucket (:class:`~asyncbus._cluster.Heartbeats`).

The bucket ``{stream}_HEARTBEATS`` holds one key per process (its instance id), the
value its latest record; the server forgets a key :data:`~asyncbus._cluster.FORGET_AFTER`
seconds after its last write (the bucket's TTL), so a process that died leaves by itself.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from .._cluster import FORGET_AFTER
from ._nats_client import broker_call
from ._nats_kv import KvBucket, NatsHost

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ["NatsHeartbeats"]


class NatsHeartbeats:
    """The heartbeats of ``transport``'s stream."""

    def __init__(self, transport: NatsHost) -> None:
        self._bucket = KvBucket(
            transport,
            f"{transport.stream}_HEARTBEATS",
            ttl=FORGET_AFTER,
            description="asyncbus processes' heartbeats (identity and statistics)",
        )

    async def beat(self, instance: str, record: bytes) -> None:
        """Write ``instance``'s record."""

        async def put(kv: KeyValue) -> None:
            await kv.put(instance, record)

        with broker_call("cannot write a heartbeat"):
            await self._bucket.call(put)

    async def beats(self) -> list[bytes]:
        """Every record the bucket holds."""
        from nats.js.errors import KeyNotFoundError, NoKeysError

        async def read(kv: KeyValue) -> list[bytes]:
            try:
                keys = await kv.keys()
            except NoKeysError:
                return []

            async def value(key: str) -> bytes | None:
                try:
                    entry = await kv.get(key)
                except KeyNotFoundError:
                    return None  # deleted meanwhile
                return entry.value

            values = await asyncio.gather(*(value(key) for key in keys))
            return [value for value in values if value]

        with broker_call("cannot read the heartbeats"):
            return await self._bucket.call(read)

    async def forget(self, instance: str) -> None:
        """Delete ``instance``'s record."""

        async def purge(kv: KeyValue) -> None:
            await kv.purge(instance)

        with broker_call("cannot delete a heartbeat"):
            await self._bucket.call(purge)
