"""The Redis store of shared rate limits: one key per bucket holding its TAT.

A turn is taken by one Lua script (atomic on the server), on the server's clock
(``TIME``), so the replicas' clocks do not matter. A key expires once its bucket is
full again (nothing owed), so idle buckets cost nothing. See :mod:`asyncbus._rates`.
"""

from __future__ import annotations

import hashlib

from .._exceptions import TransportError
from ._redis_dedup import RedisHost, Scripts

__all__ = ["RedisRateStore"]

#: KEYS[1] the bucket; ARGV interval (seconds), burst. Returns the wait in seconds (a
#: string: Lua numbers reach the client as integers). A value this store did not write
#: (not a number) counts as a new bucket.
_TAKE = """
if redis.replicate_commands then redis.replicate_commands() end
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1000000
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local earliest = now - (burst - 1) * interval
local turn = earliest
local tat = tonumber(redis.pcall('GET', KEYS[1]))
if tat and tat > earliest then turn = tat end
local after = turn + interval
local keep = math.ceil((after - now + (burst - 1) * interval) * 1000) + 1000
redis.call('SET', KEYS[1], string.format('%.6f', after), 'PX', keep)
local wait = turn - now
if wait < 0 then wait = 0 end
return string.format('%.6f', wait)
"""


class RedisRateStore:
    """A :class:`~asyncbus._rates.RateStore` in the transport's Redis.

    Made by :meth:`RedisTransport.rate_store`; usable while the transport is connected.
    """

    def __init__(self, transport: RedisHost) -> None:
        self._prefix = f"{transport.key_base}:rate:"
        self._scripts = Scripts(transport)

    async def take(self, key: str, interval: float, burst: int) -> float:
        """Take the next turn of bucket ``key``: seconds until it is due."""
        name = self._prefix + hashlib.sha256(key.encode()).hexdigest()[:40]
        found = await self._scripts.run(
            _TAKE, [name], [repr(interval), burst], f"taking a turn of rate limit {key!r}"
        )
        try:
            wait = float(found)
        except (TypeError, ValueError):
            raise TransportError(f"Redis: unexpected rate limit reply {found!r}") from None
        return wait if wait > 0 else 0.0
