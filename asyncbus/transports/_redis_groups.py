"""The groups a Redis prefix holds, listed and deleted (:class:`~.base.GroupAdmin`).

A group is a binding: its stream (``{prefix}:stage:{pattern}@{group}``) with one
consumer group, and its entry in the hash ``{prefix}:bindings``.

Redis cannot say which consumers are reading: one blocked on an empty stream is idle
for Redis (7.0 does not even create it before its first entry). So every transport
tells, in the hash ``{prefix}:readers``, field ``{stream} {consumer}``, value
``"{seen ms}:{until ms}"``: written when a subscription begins, every ``claim_interval``
while it lasts (until = three intervals and a second later), and with until = seen when
it ends. A consumer is reading while its ``until`` is ahead; the group was last active
at its newest ``seen``. Entries a day past their ``until`` are dropped by listings.

Listing reads the bindings and the readers, then, in one pipeline, each stream's
length and its delayed retries. Deleting is one script: the binding, the stream with
its entries and consumer group, the delayed retries waiting for it, its readers, and a
new version of the bindings, so every process's next publish reads them again before
it writes (the publish script checks the version first) and neither reaches nor names
the group.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .._exceptions import DecodeError
from .._groups import GroupInfo
from ._kit.routes import is_inbox
from ._redis_dedup import RedisHost
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = [
    "DELETE_BINDING_DATA",
    "DELETE_GROUP",
    "DELETE_REGISTRATION",
    "Bound",
    "GroupsHost",
    "Reader",
    "RedisGroups",
]

logger = logging.getLogger("asyncbus.transport.redis")

#: How long after its end a reader's entry is kept (for the group's last activity).
_FORGET_MS = 24 * 3600 * 1000

#: Delete a binding and everything it holds. KEYS[1] the bindings hash, KEYS[2] their
#: version, KEYS[3] the stream, KEYS[4] the sorted set of delayed retries, KEYS[5] the
#: hash of their counts per stream; ARGV the stream's name, a new version.
#: KEYS[6] the readers hash. Returns 1 if the binding or its stream existed, else 0.
DELETE_GROUP = """
local existed = redis.call('HDEL', KEYS[1], ARGV[1]) + redis.call('DEL', KEYS[3])
local readers = redis.call('HKEYS', KEYS[6])
local head = ARGV[1] .. ' '
for _, field in ipairs(readers) do
  if string.sub(field, 1, #head) == head then redis.call('HDEL', KEYS[6], field) end
end
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


#: Delete a binding's registration (on a cluster whose bindings spread over slots: its
#: stream and retries are deleted apart, by ``DELETE_BINDING_DATA``, after it; its entry
#: in the index of bindings with retries stays for the mover, which drops it once it
#: finds nothing there). KEYS[1] the bindings hash, KEYS[2] their version, KEYS[3] the
#: readers hash; ARGV the stream's name, a new version. Returns 1 if the binding
#: existed, else 0.
DELETE_REGISTRATION = """
local existed = redis.call('HDEL', KEYS[1], ARGV[1])
local head = ARGV[1] .. ' '
for _, field in ipairs(redis.call('HKEYS', KEYS[3])) do
  if string.sub(field, 1, #head) == head then redis.call('HDEL', KEYS[3], field) end
end
redis.call('SET', KEYS[2], ARGV[2])
return existed
"""

#: Delete a binding's stream and its delayed retries (one slot on a cluster). KEYS[1]
#: the stream, KEYS[2] its sorted set of retries. Returns 1 if anything existed, else 0.
DELETE_BINDING_DATA = """
local existed = redis.call('DEL', KEYS[1])
for _, item in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  existed = existed + redis.call('DEL', item)
end
redis.call('DEL', KEYS[2])
if existed > 0 then return 1 end
return 0
"""


class Bound(Protocol):
    """The bindings a transport made (:class:`~._redis_bindings.RedisBindings`)."""

    #: Binding streams this transport made (forgotten when one is deleted).
    bound: set[str]


class GroupsHost(RedisHost, Protocol):
    """What the groups use of their transport (:class:`~.redis.RedisTransport`)."""

    claim_interval: float
    _bindings_key: str
    _version_key: str
    _delayed_key: str
    _delayed_counts_key: str

    @property
    def _bindings(self) -> Bound:
        """The bindings this transport made."""
        ...

    def stream_key(self, pattern: str, group: str) -> str:
        """The key of the binding's stream."""
        ...

    def delayed_key_of(self, stream: str) -> str:
        """The sorted set of delayed retries ``stream``'s are in."""
        ...


class Reader(Protocol):
    """A consumer, as the readers hash names it."""

    stream: str
    name: str


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisGroups:
    """Listing and deleting the groups of ``transport``'s prefix.

    :param transport: the connected transport (its client, keys and settings).
    """

    def __init__(self, transport: GroupsHost) -> None:
        self.transport = transport
        self._scripts: dict[str, AsyncScript] = {}

    @property
    def key(self) -> str:
        """The hash of readers."""
        return f"{self.transport.key_base}:readers"

    def queue_reading(self, pipe: Any, consumers: Iterable[Reader], *, ending: bool) -> None:
        """Tell (on ``pipe``) that ``consumers`` read now, and until when (now, if ``ending``)."""
        now = int(time.time() * 1000)
        until = now if ending else now + int((3 * self.transport.claim_interval + 1) * 1000)
        mapping = {f"{c.stream} {c.name}": f"{now}:{until}" for c in consumers}
        if mapping:
            pipe.hset(self.key, mapping=mapping)

    async def tell_reading(self, consumers: Iterable[Reader], *, ending: bool = False) -> None:
        """:meth:`queue_reading`, sent now; a failure is logged only (it stops nothing:
        the readers serve listings)."""
        try:
            pipe = self.transport._redis().pipeline(transaction=False)
            self.queue_reading(pipe, consumers, ending=ending)
            await pipe.execute()
        except Exception as error:
            logger.debug("Redis: telling which consumers read failed: %s", error)

    async def _readers(self, client: Any) -> dict[str, tuple[int, float | None]]:
        """Per stream: its consumers reading now, and the newest time one was seen."""
        found: dict[Any, Any] = await client.hgetall(self.key)
        now = time.time() * 1000
        readers: dict[str, tuple[int, float | None]] = {}
        stale = []
        for field, value in found.items():
            stream, _, _name = _text(field).rpartition(" ")
            try:
                seen_text, _, until_text = _text(value).partition(":")
                seen, until = int(seen_text), int(until_text)
            except ValueError:  # another client wrote it
                stale.append(field)
                continue
            if until < now - _FORGET_MS:
                stale.append(field)
            count, newest = readers.get(stream, (0, None))
            readers[stream] = (
                count + (until > now),
                seen / 1000 if newest is None else max(newest, seen / 1000),
            )
        if stale:
            await client.hdel(self.key, *stale)
        return readers

    async def groups(self) -> list[GroupInfo]:
        """Every binding but request inboxes, with backlog, readers and last activity."""
        transport = self.transport
        client = transport._redis()
        found: dict[Any, Any] = await client.hgetall(transport._bindings_key)
        readers = await self._readers(client)
        bindings: list[tuple[str, str, str]] = []
        for stream, value in found.items():
            try:
                pattern, group = group_from_wire(value)
            except DecodeError as error:  # written by another client
                logger.warning("Redis: skipping unreadable binding %r: %s", stream[:200], error)
                continue
            if not is_inbox(group):
                bindings.append((_text(stream), pattern, group))
        if not bindings:
            return []
        pipe = client.pipeline(transaction=False)
        for stream, _pattern, _group in bindings:
            pipe.xlen(stream)
            if transport.cluster:  # a binding's retries are in its own set
                pipe.zcard(transport.delayed_key_of(stream))
            else:
                pipe.hget(transport._delayed_counts_key, stream)
        replies = await pipe.execute(raise_on_error=False)
        listed = []
        for at, (stream, pattern, group) in enumerate(bindings):
            length, delayed = replies[2 * at : 2 * at + 2]
            backlog = length if isinstance(length, int) else 0
            with contextlib.suppress(TypeError, ValueError):  # another client wrote it
                backlog += max(int(delayed or 0), 0)
            reading, seen = readers.get(stream, (0, None))
            listed.append(GroupInfo(pattern, group, backlog, reading, seen))
        return listed

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the binding, its stream and its delayed retries (one script; on a
        cluster, the registration then the stream and retries in their slot)."""
        transport = self.transport
        stream = transport.stream_key(pattern, group)
        if transport.cluster:
            try:
                deleted = await self._script(DELETE_REGISTRATION)(
                    keys=[transport._bindings_key, transport._version_key, self.key],
                    args=[stream, secrets.token_hex(8)],
                )
                deleted += await self._script(DELETE_BINDING_DATA)(
                    keys=[stream, transport.delayed_key_of(stream)]
                )
            except transport._errors.RedisError as error:
                raise transport._failed(f"deleting group {pattern}@{group}", error) from error
            transport._bindings.bound.discard(stream)
            return bool(deleted)
        try:
            deleted = await self._script(DELETE_GROUP)(
                keys=[
                    transport._bindings_key,
                    transport._version_key,
                    stream,
                    transport._delayed_key,
                    transport._delayed_counts_key,
                    self.key,
                ],
                args=[stream, secrets.token_hex(8)],
            )
        except transport._errors.RedisError as error:
            raise transport._failed(f"deleting group {pattern}@{group}", error) from error
        transport._bindings.bound.discard(stream)
        return bool(deleted)

    def _script(self, source: str) -> AsyncScript:
        """The script of Lua ``source`` (one of this module's), registered once."""
        script = self._scripts.get(source)
        if script is None:
            script = self.transport._redis().register_script(source)
            self._scripts[source] = script
        return script
