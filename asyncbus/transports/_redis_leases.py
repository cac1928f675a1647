"""The Redis store of ``max_in_flight``'s slots: one sorted set per stage, a member per
lease holder scored by when its lease runs out.

Each step is one Lua script on the server's clock (``TIME``), so the replicas' clocks
do not matter: taking a slot drops the leases run out and adds the holder when fewer
than ``limit`` remain. The set expires a little after its newest lease. See
:mod:`asyncbus._leases`.
"""

from __future__ import annotations

import hashlib
import math

from .._exceptions import TransportError
from ._redis_dedup import RedisHost, Scripts

__all__ = ["RedisLeaseStore"]

_NOW = """
if redis.replicate_commands then redis.replicate_commands() end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
"""

#: KEYS[1] the set; ARGV limit, holder, lease (ms). 1 when the holder has a slot now.
_ACQUIRE = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease = tonumber(ARGV[3])
if redis.call('ZSCORE', KEYS[1], ARGV[2]) == false
    and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
redis.call('PEXPIRE', KEYS[1], lease + 1000)
return 1
"""
)

#: KEYS[1] the set; ARGV lease (ms), holders... The holders whose lease was still held.
_RENEW = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease = tonumber(ARGV[1])
local kept = 0
for index = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[index]) ~= false then
    redis.call('ZADD', KEYS[1], now + lease, ARGV[index])
    kept = kept + 1
  end
end
if kept > 0 then redis.call('PEXPIRE', KEYS[1], lease + 1000) end
return kept
"""
)

#: KEYS[1] the set; ARGV holder.
_RELEASE = """
return redis.call('ZREM', KEYS[1], ARGV[1])
"""


#: KEYS[1] the set. How many leases have not run out.
_COUNT = (
    _NOW
    + """
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
"""
)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class RedisLeaseStore:
    """A :class:`~asyncbus._leases.LeaseStore` in the transport's Redis.

    Made by :meth:`RedisTransport.lease_store`; usable while the transport is connected.
    """

    def __init__(self, transport: RedisHost) -> None:
        self._prefix = f"{transport.key_base}:slots:"
        self._scripts = Scripts(transport)

    def _key(self, name: str) -> str:
        return self._prefix + hashlib.sha256(name.encode()).hexdigest()[:40]

    async def acquire(self, name: str, limit: int, holder: str, lease: float) -> bool:
        """Take one of the ``limit`` slots of ``name`` for ``holder``: whether one was free."""
        found = await self._scripts.run(
            _ACQUIRE,
            [self._key(name)],
            [limit, holder, _ms(lease)],
            f"taking a slot of {name!r}",
        )
        if found not in (0, 1):
            raise TransportError(f"Redis: unexpected slot reply {found!r}")
        return bool(found)

    async def renew(self, name: str, holders: list[str], lease: float) -> int:
        """Extend ``holders``' leases on ``name``: how many were still held."""
        found = await self._scripts.run(
            _RENEW, [self._key(name)], [_ms(lease), *holders], f"renewing slots of {name!r}"
        )
        if not isinstance(found, int):
            raise TransportError(f"Redis: unexpected slot reply {found!r}")
        return found

    async def release(self, name: str, holder: str) -> None:
        """Give ``holder``'s slot of ``name`` back."""
        await self._scripts.run(
            _RELEASE, [self._key(name)], [holder], f"giving back a slot of {name!r}"
        )

    async def count(self, name: str) -> int:
        """How many leases of ``name`` have not run out."""
        found = await self._scripts.run(
            _COUNT, [self._key(name)], [], f"counting the leases of {name!r}"
        )
        if not isinstance(found, int):
            raise TransportError(f"Redis: unexpected lease count {found!r}")
        return found
