"""The Redis store of ``deduplicate()``: one key per (stage, envelope id), expiring by itself.

``{prefix}:dedup:{stage}/{id}`` holds ``claim:{owner}`` with a TTL of the lease
(``SET NX PX``), then ``done`` with a TTL of the window. Each step is one Lua script,
so a claim never races another; expiry is the server's, so clocks do not matter. A
key holding anything else (written by another client) counts as absent.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from .._dedup import Claim
from .._exceptions import TransportError

if TYPE_CHECKING:
    from redis.asyncio import Redis

__all__ = ["RedisDedupStore", "RedisHost", "Scripts"]


class RedisHost(Protocol):
    """What the store uses of its transport (:class:`~.redis.RedisTransport` is one)."""

    prefix: str
    #: What every key starts with (the prefix, hash-tagged on a cluster).
    key_base: str
    #: Talking to a Redis Cluster (the bindings' keys spread over its slots).
    cluster: bool
    #: redis-py's errors the transport catches (``RedisError``, ``ResponseError``).
    _errors: Any

    def _redis(self) -> Redis:
        """The connected client (:class:`TransportError` when not connected)."""
        ...

    def _failed(self, doing: str, error: BaseException) -> TransportError:
        """The error to raise when ``doing`` failed with ``error``."""
        ...


#: KEYS[1] the key; ARGV owner, lease ms. Returns 1 claimed, 2 done, 3 busy. A value
#: this store did not write (another client's: not a string, or neither ``done`` nor a
#: claim) is taken over, as an absent key would be.
_CLAIM = """
local mine = 'claim:' .. ARGV[1]
if redis.call('SET', KEYS[1], mine, 'NX', 'PX', ARGV[2]) then return 1 end
local value = redis.pcall('GET', KEYS[1])
if value == 'done' then return 2 end
if value == mine or type(value) ~= 'string' or string.sub(value, 1, 6) ~= 'claim:' then
  redis.call('SET', KEYS[1], mine, 'PX', ARGV[2])
  return 1
end
return 3
"""

#: KEYS[1] the key; ARGV owner, lease ms. Returns 1 when the owner still held it.
_EXTEND = """
if redis.pcall('GET', KEYS[1]) == 'claim:' .. ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

#: KEYS[1] the key; ARGV owner. Deletes the owner's claim only.
_RELEASE = """
if redis.pcall('GET', KEYS[1]) == 'claim:' .. ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_CLAIMS = {1: Claim.CLAIMED, 2: Claim.DONE, 3: Claim.BUSY}


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


class Scripts:
    """Lua scripts run on a transport's Redis, each registered once per client (again
    on the client a reconnection made)."""

    def __init__(self, transport: RedisHost) -> None:
        self._transport = transport
        self._registered: dict[str, Any] = {}

    async def run(self, script: str, keys: list[str], args: list[Any], doing: str) -> Any:
        """``script``'s reply; redis-py's errors raised as the transport's, for ``doing``."""
        transport = self._transport
        client = transport._redis()
        registered = self._registered.get(script)
        if registered is None or registered.registered_client is not client:
            registered = self._registered[script] = client.register_script(script)
        try:
            return await registered(keys=keys, args=args)
        except transport._errors.RedisError as error:
            raise transport._failed(doing, error) from error


class RedisDedupStore:
    """A :class:`~asyncbus.middleware.deduplicate.DedupStore` in the transport's Redis.

    Made by :meth:`RedisTransport.dedup_store`; usable while the transport is connected.
    """

    def __init__(self, transport: RedisHost) -> None:
        self._transport = transport
        self._prefix = f"{transport.key_base}:dedup:"
        self._scripts = Scripts(transport)

    async def _run(self, script: str, key: str, *args: str | int) -> Any:
        return await self._scripts.run(
            script, [self._prefix + key], list(args), f"deduplicating {key!r}"
        )

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """Claim ``key`` for ``owner`` for ``lease`` seconds, unless done or claimed."""
        found = await self._run(_CLAIM, key, owner, _ms(lease))
        try:
            return _CLAIMS[int(found)]
        except (KeyError, TypeError, ValueError):
            raise TransportError(f"Redis: unexpected claim reply {found!r}") from None

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep ``owner``'s claim ``lease`` more seconds; ``False`` if it is not held."""
        return bool(await self._run(_EXTEND, key, owner, _ms(lease)))

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Remember ``key`` as handled for ``ttl`` seconds."""
        client = self._transport._redis()
        try:
            await client.set(self._prefix + key, "done", px=_ms(ttl))
        except self._transport._errors.RedisError as error:
            raise self._transport._failed(f"deduplicating {key!r}", error) from error

    async def release(self, key: str, owner: str) -> None:
        """Forget ``owner``'s claim of ``key``."""
        await self._run(_RELEASE, key, owner)
