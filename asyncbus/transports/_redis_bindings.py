"""The bindings of a Redis prefix as one transport sees them: made and registered for its
subscriptions (kept registered while they last), read back and routed by, and the
expiry of its request inboxes.

A binding is a stream ``{prefix}:stage:{pattern}@{group}`` with one consumer group, and
its entry in the hash ``{prefix}:bindings``; ``{prefix}:bindings:version`` changes with
every registration and deletion, so a transport knows when the routes it cached are
stale. Request inboxes (groups ``_reply.*``) are also listed by expiry in
``{prefix}:inboxes``.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections.abc import Callable, Set
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._exceptions import DecodeError
from .._routing import compile_pattern
from ._kit import TopicMatches
from ._kit.routes import is_inbox
from ._redis_dedup import RedisHost
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

    from ._redis_groups import RedisGroups

__all__ = ["BindingsHost", "RedisBindings", "Subscriber", "text"]

logger = logging.getLogger("asyncbus.transport.redis")

#: Sets of binding streams whose stage names are remembered.
_NAMED_SETS = 8192


def text(value: bytes | str) -> str:
    """``value`` as a string (Redis answers bytes)."""
    return value.decode() if isinstance(value, bytes) else value


class Subscriber(Protocol):
    """A subscription's consumer, as the bindings see it."""

    pattern: str
    group: str
    stream: str
    name: str


class BindingsHost(RedisHost, Protocol):
    """What the bindings use of their transport (:class:`~.redis.RedisTransport`)."""

    inbox_ttl: float
    claim_interval: float
    _bindings_key: str
    _version_key: str
    _inboxes_key: str
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]

    @property
    def _consumers(self) -> Set[Subscriber]:
        """The consumers of this transport's subscriptions."""
        ...

    @property
    def _groups(self) -> RedisGroups:
        """The groups of the prefix (which consumers read)."""
        ...

    def stream_key(self, pattern: str, group: str) -> str:
        """The key of the binding's stream."""
        ...


class RedisBindings:
    """The bindings ``transport`` made, and its routes: the bindings as of ``version``."""

    def __init__(self, transport: BindingsHost) -> None:
        self.transport = transport
        #: Binding streams this transport made (forgotten when one is deleted).
        self.bound: set[str] = set()
        #: The bindings as of :attr:`version` (``None``: not read yet): (matcher, stream).
        self.matchers: list[tuple[Callable[[str], bool], str]] | None = None
        self.version: bytes | None = None
        #: Binding stream -> its stage name ("pattern@group").
        self.names: dict[str, str] = {}
        #: Binding streams a publish reached -> their stage names, sorted.
        self.stage_names: dict[frozenset[str], tuple[str, ...]] = {}
        #: Streams of request inboxes among the bindings (written with NOMKSTREAM).
        self.inbox_streams: set[str] = set()
        self._routes = TopicMatches()

    async def bind(self, pattern: str, group: str) -> str:
        """Create the binding's stream and group (if needed) and register it."""
        transport = self.transport
        transport._redis()  # not connected: TransportError, before any redis error is looked at
        try:
            return await self.bind_raw(pattern, group)
        except transport._errors.RedisError as error:
            raise transport._failed(f"binding {pattern}@{group}", error) from error

    async def bind_raw(self, pattern: str, group: str) -> str:
        """:meth:`bind`, redis-py's errors raised as they are."""
        transport = self.transport
        stream = transport.stream_key(pattern, group)
        client = transport._redis()
        try:
            await client.xgroup_create(stream, group, id="0", mkstream=True)
        except transport._errors.ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise
        inbox = is_inbox(group)
        if inbox and transport.cluster:
            # The stream is in a slot of its own: its expiry is written first, apart.
            await client.pexpire(stream, _ttl_ms(transport.inbox_ttl))
        pipe = client.pipeline(transaction=True)
        pipe.hset(transport._bindings_key, stream, json.dumps([pattern, group]))
        pipe.set(transport._version_key, secrets.token_hex(8))
        if inbox:
            self.queue_inbox_expiry(pipe, stream, of_stream=not transport.cluster)
        await pipe.execute()
        self.bound.add(stream)
        return stream

    def queue_inbox_expiry(self, pipe: Any, stream: str, *, of_stream: bool = True) -> None:
        """Push the expiry of inbox ``stream`` ``inbox_ttl`` ahead (on ``pipe``): in the
        sorted set of inboxes, and (``of_stream``) the stream's own."""
        ttl_ms = _ttl_ms(self.transport.inbox_ttl)
        pipe.zadd(self.transport._inboxes_key, {stream: int(time.time() * 1000) + ttl_ms})
        if of_stream:
            pipe.pexpire(stream, ttl_ms)

    async def _read(self) -> tuple[dict[bytes, bytes], bytes | None]:
        transport = self.transport
        pipe = transport._redis().pipeline(transaction=True)
        pipe.hgetall(transport._bindings_key)
        pipe.get(transport._version_key)
        found, version = await pipe.execute()
        return found, version

    async def load(self) -> None:
        """Read the bindings and their version; forget the routes made from the last."""
        found, version = await self._read()
        registered = {text(stream) for stream in found}
        lost = [c for c in self.transport._consumers if c.stream not in registered]
        if lost:
            # Bindings of this process's subscriptions the server does not have: it lost
            # them (a restart without persistence, a flush; another subscription may
            # have made its own again already, so the version alone does not tell).
            # Make them again before routing, so a publish does not miss these groups
            # until their next read.
            for consumer in lost:
                await self.bind_raw(consumer.pattern, consumer.group)
            found, version = await self._read()
        matchers: list[tuple[Callable[[str], bool], str]] = []
        inboxes: set[str] = set()
        names: dict[str, str] = {}
        for stream, value in found.items():
            try:
                pattern, group = group_from_wire(value)
                key = text(stream)
            except (DecodeError, UnicodeDecodeError) as error:  # written by another client
                logger.warning("Redis: skipping unreadable binding %r: %s", stream[:200], error)
                continue
            matchers.append((compile_pattern(pattern), key))
            names[key] = f"{pattern}@{group}"
            if is_inbox(group):
                inboxes.add(key)
        self.matchers = matchers
        self.inbox_streams = inboxes
        self.names = names
        self.stage_names = {}
        self.version = version
        self._routes.clear()

    def route(self, topic: str) -> tuple[str, ...]:
        """The binding streams whose pattern matches ``topic``."""
        return self._routes.lookup(topic, self.matchers or ())

    def name(self, reached: set[str]) -> tuple[str, ...]:
        """The stage names of the binding streams ``reached``, sorted (remembered: the
        next publish reaching them finds them in :attr:`stage_names`)."""
        named = tuple(sorted(self.names.get(stream, stream) for stream in reached))
        if len(self.stage_names) >= _NAMED_SETS:
            self.stage_names.clear()
        self.stage_names[frozenset(reached)] = named
        return named

    async def keep_registered(self) -> None:
        """Register again, every ``claim_interval``, the bindings of this process's
        subscriptions that are gone from Redis (a flush, a restart without persistence).

        A consumer that reads finds its stream gone and makes it again at once; one that
        does not read (its stage is full, its handlers are long) would leave its group
        unknown to publishers meanwhile, and their publishes dead letters
        ``no_subscribers``.
        """
        transport = self.transport
        while True:
            await anyio.sleep(transport.claim_interval)
            consumers = list(transport._consumers)
            if not consumers:
                continue
            readers = [c for c in consumers if not is_inbox(c.group)]
            await transport._groups.tell_reading(readers)
            try:
                found = await transport._redis().hmget(
                    transport._bindings_key, [c.stream for c in consumers]
                )
                for consumer, binding in zip(consumers, found, strict=True):
                    if binding is None and consumer in transport._consumers:
                        logger.warning(
                            "Redis: the binding of %s@%s is gone; registering it again",
                            consumer.pattern,
                            consumer.group,
                        )
                        await self.bind_raw(consumer.pattern, consumer.group)
            except Exception as error:  # keep going: the next round tries again
                logger.debug("Redis: looking at the bindings failed: %s", error)

    async def keep_inboxes(self) -> None:
        """Push the expiry of this process's inboxes forward; delete expired ones."""
        transport = self.transport
        while True:
            try:
                pipe = transport._redis().pipeline(transaction=False)
                for stream in {c.stream for c in transport._consumers if is_inbox(c.group)}:
                    self.queue_inbox_expiry(pipe, stream)
                await pipe.execute()
                gone = await transport._scripts["REAP_INBOXES"](
                    keys=[transport._inboxes_key, transport._bindings_key, transport._version_key],
                    args=[int(time.time() * 1000), secrets.token_hex(8), int(transport.cluster)],
                )
                if transport.cluster:  # the streams are in slots of their own
                    for stream in gone:
                        await transport._redis().delete(stream)
            except Exception as error:  # keep going: the next round tries again
                logger.warning("Redis: keeping request inboxes failed: %s", error)
            await anyio.sleep(transport.inbox_ttl / 3)

    async def drop_inbox(self, stream: str, *, within: float) -> None:
        """Delete the inbox ``stream`` its last consumer leaves: the stream, its binding
        and expiry (replies to it are moot), taking at most ``within`` seconds."""
        transport = self.transport
        if any(other.stream == stream for other in transport._consumers):
            return
        pipe = transport._redis().pipeline(transaction=True)
        if not transport.cluster:
            pipe.delete(stream)
        pipe.hdel(transport._bindings_key, stream)
        pipe.zrem(transport._inboxes_key, stream)
        pipe.set(transport._version_key, secrets.token_hex(8))
        with anyio.move_on_after(within):
            try:
                await pipe.execute()
                if transport.cluster:  # (its stream is in a slot of its own)
                    await transport._redis().delete(stream)
            except transport._errors.RedisError as error:
                logger.warning(
                    "Redis: deleting the inbox %s failed (it expires within %g s): %s",
                    stream,
                    transport.inbox_ttl,
                    error,
                )
        self.bound.discard(stream)


def _ttl_ms(seconds: float) -> int:
    """``seconds`` in whole milliseconds, rounded up."""
    return math.ceil(seconds * 1000)
