"""The groups a Redis prefix holds, listed and deleted (:class:`~.base.GroupAdmin`).

A group is a binding: its stream (``{prefix}:stage:{pattern}@{group}``) with one
consumer group, and its entry in the hash ``{prefix}:bindings``. Listing reads the hash,
then, in one pipeline, each stream's length, its delayed retries and its consumers
(``XINFO CONSUMERS``: a consumer idle less than twice ``ack_timeout`` is reading; the
sentinel that holds handed-back entries is none). Deleting is one script: the binding,
the stream with its entries and consumer group, the delayed retries waiting for it,
and a new version of the bindings, so every process's next publish reads them again
before it writes (the publish script checks the version first) and neither reaches nor
names the group.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from .._exceptions import DecodeError
from .._groups import GroupInfo, since
from ._wire_fields import group_from_wire
from .base import INBOX_GROUP_PREFIX

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

    from .redis import RedisTransport

__all__ = ["DELETE_GROUP", "RedisGroups"]

logger = logging.getLogger("asyncbus.transport.redis")

#: Delete a binding and everything it holds. KEYS[1] the bindings hash, KEYS[2] their
#: version, KEYS[3] the stream, KEYS[4] the sorted set of delayed retries, KEYS[5] the
#: hash of their counts per stream; ARGV the stream's name, a new version.
#: Returns 1 if the binding or its stream existed, else 0.
DELETE_GROUP = """
local existed = redis.call('HDEL', KEYS[1], ARGV[1]) + redis.call('DEL', KEYS[3])
local items = redis.call('ZRANGE', KEYS[4], 0, -1)
for _, item in ipairs(items) do
  if redis.call('HGET', item, 'stream') == ARGV[1] then
    redis.call('ZREM', KEYS[4], item)
    redis.call('DEL', item)
    existed = existed + 1
  end
end
redis.call('HDEL', KEYS[5], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
if existed > 0 then return 1 end
return 0
"""


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisGroups:
    """Listing and deleting the groups of ``transport``'s prefix.

    :param transport: the connected transport (its client, keys and settings).
    :param sentinel: the consumer that holds handed-back entries (not a reader).
    """

    def __init__(self, transport: RedisTransport, sentinel: str) -> None:
        self.transport = transport
        self.sentinel = sentinel
        self._script: AsyncScript | None = None

    async def groups(self) -> list[GroupInfo]:
        """Every binding but request inboxes, with backlog, readers and last activity."""
        transport = self.transport
        client = transport._redis()
        found: dict[Any, Any] = await client.hgetall(transport._bindings_key)
        bindings: list[tuple[str, str, str]] = []
        for stream, value in found.items():
            try:
                pattern, group = group_from_wire(value)
            except DecodeError as error:  # written by another client
                logger.warning("Redis: skipping unreadable binding %r: %s", stream[:200], error)
                continue
            if not group.startswith(INBOX_GROUP_PREFIX):
                bindings.append((_text(stream), pattern, group))
        if not bindings:
            return []
        pipe = client.pipeline(transaction=False)
        for stream, _pattern, group in bindings:
            pipe.xlen(stream)
            pipe.hget(transport._delayed_counts_key, stream)
            pipe.xinfo_consumers(stream, group)
        replies = await pipe.execute(raise_on_error=False)
        live_ms = transport.ack_timeout * 2000
        listed = []
        for at, (_stream, pattern, group) in enumerate(bindings):
            length, delayed, consumers = replies[3 * at : 3 * at + 3]
            backlog = length if isinstance(length, int) else 0
            try:
                backlog += max(int(delayed or 0), 0)
            except (TypeError, ValueError):  # another client wrote it
                pass
            idle: list[float] = []
            if isinstance(consumers, list):  # (an error: the stream or group is gone)
                for consumer in consumers:
                    if _text(consumer.get("name", b"")) != self.sentinel:
                        idle.append(float(consumer.get("idle", 0)))
            readers = sum(1 for ms in idle if ms < live_ms)
            listed.append(
                GroupInfo(pattern, group, backlog, readers, since(min(idle)) if idle else None)
            )
        return listed

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the binding, its stream and its delayed retries (one script)."""
        transport = self.transport
        client = transport._redis()
        if self._script is None:
            self._script = client.register_script(DELETE_GROUP)
        stream = transport.stream_key(pattern, group)
        try:
            deleted = await self._script(
                keys=[
                    transport._bindings_key,
                    transport._version_key,
                    stream,
                    transport._delayed_key,
                    transport._delayed_counts_key,
                ],
                args=[stream, secrets.token_hex(8)],
            )
        except transport._errors.RedisError as error:
            raise transport._failed(f"deleting group {pattern}@{group}", error) from error
        transport._bound.discard(stream)
        return bool(deleted)
