"""Each process's heartbeat in a Redis prefix (:class:`~asyncbus._cluster.Heartbeats`).

Two keys: the hash ``{prefix}:heartbeats`` (instance -> its latest record) and the
sorted set ``{prefix}:heartbeats:seen`` (instance -> when it last wrote, ms). A write
sets both and drops the records not written for :data:`~asyncbus._cluster.FORGET_AFTER`
seconds (a process that died), so the hash stays as small as the deployment.
"""

from __future__ import annotations

import time
from typing import cast

from .._cluster import FORGET_AFTER
from ._redis_dedup import RedisHost

__all__ = ["RedisHeartbeats"]

#: KEYS[1] the hash, KEYS[2] the sorted set; ARGV instance, record, now ms, forget ms.
_BEAT = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[3] - ARGV[4])
for _, instance in ipairs(gone) do
  redis.call('HDEL', KEYS[1], instance)
  redis.call('ZREM', KEYS[2], instance)
end
return #gone
"""


class RedisHeartbeats:
    """The heartbeats of ``transport``'s prefix."""

    def __init__(self, transport: RedisHost) -> None:
        self.transport = transport

    @property
    def keys(self) -> list[str]:
        """The hash of records and the sorted set of their times."""
        base = self.transport.key_base
        return [f"{base}:heartbeats", f"{base}:heartbeats:seen"]

    async def beat(self, instance: str, record: bytes) -> None:
        """Write ``instance``'s record; drop those of processes long gone."""
        client = self.transport._redis()
        now = int(time.time() * 1000)
        try:
            await client.eval(_BEAT, 2, *self.keys, instance, record, now, int(FORGET_AFTER * 1000))
        except self.transport._errors.RedisError as error:
            raise self.transport._failed("writing a heartbeat", error) from error

    async def beats(self) -> list[bytes]:
        """Every record written in the last :data:`FORGET_AFTER` seconds."""
        client = self.transport._redis()
        records, seen = self.keys
        since = int((time.time() - FORGET_AFTER) * 1000)
        try:
            instances = await client.zrangebyscore(seen, since, "+inf")
            if not instances:
                return []
            values = await client.hmget(records, list(cast("list[bytes]", instances)))
        except self.transport._errors.RedisError as error:
            raise self.transport._failed("reading the heartbeats", error) from error
        return [
            value if isinstance(value, bytes) else str(value).encode()
            for value in values
            if value is not None
        ]

    async def forget(self, instance: str) -> None:
        """Delete ``instance``'s record."""
        client = self.transport._redis()
        records, seen = self.keys
        try:
            pipe = client.pipeline(transaction=True)
            pipe.hdel(records, instance)
            pipe.zrem(seen, instance)
            await pipe.execute()
        except self.transport._errors.RedisError as error:
            raise self.transport._failed("deleting a heartbeat", error) from error
