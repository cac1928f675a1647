"""The writing side of :class:`~.redis.RedisTransport`: publishes checked, encoded and
written together (one ``PUBLISH`` script call per batch, routed by the bindings of one
version), a group's own writes, what reached no group, and the wait for replicas.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from .._envelope import Envelope
from .._exceptions import TransportError
from .._routing import validate_topic
from ._coalesce import Coalescer
from ._codec import Codec, envelope_to_wire
from ._kit.options import refuse_oversized
from ._kit.outgoing import foreign_message, wire_of
from ._kit.routes import unrouted_entry
from ._redis_dedup import RedisHost

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

    from ._redis_bindings import RedisBindings
    from ._redis_dead_letters import RedisDeadLetters
    from ._redis_master import PrefixMaster

__all__ = ["PublishHost", "RedisPublisher"]

#: Topics remembered as valid (so a publish does not check its topic again).
_VALID_TOPICS = 8192
#: Share of ``publish_timeout`` a publish's ``WAIT`` may take (the rest: the write).
_WAIT_SHARE = 0.8

#: One publish waiting to be written: its topic, its envelopes as (meta, body), and the
#: binding streams the writer wrote them to (filled in by the writer).
_Publish = tuple[str, list[tuple[bytes, bytes]], set[str]]


def _arguments(
    keys: list[str], batch: list[_Publish], targets: list[list[str]], inboxes: set[str]
) -> tuple[list[str], list[bytes | str | int]]:
    """The keys (after ``keys``) and arguments of the ``PUBLISH`` script writing each
    publish of ``batch`` to its ``targets`` (see the script for their layout)."""
    index: dict[str, int] = {}
    args: list[bytes | str | int] = []
    # Consecutive publishes to the same streams (the usual burst: one topic) go in one
    # group of the script's arguments: their streams named once.
    group: list[str] | None = None
    count_at = grouped = 0
    for (_topic, wire, _done), streams in zip(batch, targets, strict=True):
        if not streams:
            continue
        if streams != group:
            group = streams
            args.append(len(streams))
            for stream in streams:
                if stream not in index:
                    keys.append(stream)
                    index[stream] = len(keys)
                # A negative index: an inbox, written only while it exists.
                args.append(-index[stream] if stream in inboxes else index[stream])
            count_at, grouped = len(args), 0
            args.append(0)
        grouped += len(wire)
        args[count_at] = grouped
        for meta, body in wire:
            args += (meta, body)
    return keys, args


class PublishHost(RedisHost, Protocol):
    """What the publisher uses of its transport (:class:`~.redis.RedisTransport`)."""

    codec: Codec
    max_message_size: int
    publish_timeout: float
    wait_replicas: int
    cluster: bool
    _version_key: str
    #: The masters of the slots written, on a cluster (``wait_replicas``).
    _master: PrefixMaster
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]

    @property
    def _bindings(self) -> RedisBindings:
        """The bindings (routes, and making a group's stream)."""
        ...

    @property
    def _shared_dead(self) -> RedisDeadLetters:
        """The dead-letter stream."""
        ...

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        ...

    def stream_key(self, pattern: str, group: str) -> str:
        """The key of the binding's stream."""
        ...


class RedisPublisher:
    """The publishes of ``transport``: sent through one writer task (:attr:`writes`)."""

    def __init__(self, transport: PublishHost) -> None:
        self.transport = transport
        self._valid_topics: set[str] = set()
        #: Publishes from concurrent tasks, written together by :meth:`write`. Made in
        #: :meth:`open`, inside the event loop that uses it.
        self.writes: Coalescer[_Publish]

    def open(self) -> None:
        """Make the writer (its task is :attr:`writes`' ``run``)."""
        self.writes = Coalescer(self.write, timeout=self.transport.publish_timeout)

    async def send(self, topic: str, envelopes: Sequence[Envelope]) -> set[str]:
        """Write the envelopes (coalesced); return the binding streams written to."""
        valid = self._valid_topics
        if topic not in valid:
            validate_topic(topic)
            if len(valid) >= _VALID_TOPICS:
                valid.clear()
            valid.add(topic)
        transport = self.transport
        transport._redis()
        reached: set[str] = set()
        if not envelopes:
            await anyio.lowlevel.checkpoint()
            return reached
        wire = [self.encode(envelope) for envelope in envelopes]
        size = sum(len(meta) + len(body) for meta, body in wire)
        # Bounded by the coalescer (publish_timeout, per batch): no cancel scope per publish.
        error = await self.writes.submit((topic, wire, reached), size)
        if error is not None:
            if isinstance(error, TimeoutError):
                raise TransportError(
                    f"Redis at {transport._shown()}: publish to {topic!r} not confirmed within "
                    f"publish_timeout={transport.publish_timeout:g} s (it may or may not be "
                    "written)"
                ) from error
            raise transport._failed(f"publish to {topic!r}", error) from error
        return reached

    def encode(self, envelope: Envelope) -> tuple[bytes, bytes]:
        """``envelope`` as (meta, body); refused when over ``max_message_size``."""
        transport = self.transport
        wire = wire_of(envelope)
        if wire is None:
            meta, body = envelope_to_wire(envelope, transport.codec)
        else:  # for clients that know nothing of asyncbus: fields, then ``body``
            body, headers, content_type = foreign_message(envelope, wire, transport.codec)
            fields = ["id", envelope.id]
            if wire != "plain":
                fields = [*(item for pair in headers.items() for item in pair), "content-type"]
                fields.append(content_type)
            meta = json.dumps(fields, separators=(",", ":")).encode()
        refuse_oversized(envelope, len(meta) + len(body), transport.max_message_size)
        return meta, body

    async def write(self, batch: list[_Publish]) -> None:
        """Write a batch of publishes with one script that also reads the bindings' version.

        When the version moved (a binding was added or deleted anywhere), nothing is
        written: the bindings are read again and the batch routed anew. The coalescer
        bounds it by the batch's ``publish_timeout``: a writer stuck on a silent server
        would hold up every publish.
        """
        transport = self.transport
        if transport.cluster:
            await self._write_spread(batch)
            return
        bindings = transport._bindings
        if bindings.matchers is None:
            await bindings.load()
        written = [done for _topic, _wire, done in batch]
        while True:
            targets = [self._targets(bindings.route(topic), done) for topic, _w, done in batch]
            keys, args = _arguments(
                [transport._version_key], batch, targets, bindings.inbox_streams
            )
            # Written only if the bindings are still those of the routes (a group
            # deleted since must not be written to, nor named).
            script = functools.partial(
                transport._scripts["PUBLISH"], keys=keys, args=[bindings.version or b"", *args]
            )
            reply = await self.replicated(script)
            if int(reply[0]):
                for done, streams in zip(written, targets, strict=True):
                    done.update(streams)
                return
            await bindings.load()

    @staticmethod
    def _targets(route: tuple[str, ...], done: set[str]) -> list[str]:
        """The streams of ``route`` not written yet."""
        return [stream for stream in route if stream not in done] if done else [*route]

    async def _write_spread(self, batch: list[_Publish]) -> None:
        """:meth:`write` on a cluster whose bindings spread over slots: the version read
        first (the routes made again when it moved), then one script call per slot of
        the streams reached, the slots written concurrently. A binding registered before
        the publish began is in the version read; a group deleted while the publish is
        written may receive it (its stream made again, without a group: deleting the
        group again removes it). A slot that fails fails the publish; the slots written
        stay written (at-least-once, as a publish cut off by a lost connection).
        """
        transport = self.transport
        bindings = transport._bindings
        version = await transport._redis().get(transport._version_key)
        if bindings.matchers is None or version != bindings.version:
            await bindings.load()
        targets = [self._targets(bindings.route(topic), done) for topic, _w, done in batch]
        from redis.crc import key_slot

        slots: dict[int, set[str]] = {}
        for route in targets:
            for stream in route:
                slots.setdefault(key_slot(stream.encode()), set()).add(stream)

        async def write_slot(streams: set[str]) -> None:
            in_slot = [[stream for stream in each if stream in streams] for each in targets]
            first = next(iter(streams))
            keys, args = _arguments([first], batch, in_slot, bindings.inbox_streams)
            script = functools.partial(transport._scripts["PUBLISH"], keys=keys, args=["-", *args])
            await self.replicated(script, key=first)
            for (_topic, _wire, done), written in zip(batch, in_slot, strict=True):
                done.update(written)

        if len(slots) == 1:
            await write_slot(next(iter(slots.values())))
            return
        failures: list[Exception] = []

        async def write_or_tell(streams: set[str]) -> None:
            try:
                await write_slot(streams)
            except Exception as error:  # the others go on: a slot written is not undone
                failures.append(error)

        async with anyio.create_task_group() as group:
            for in_one_slot in slots.values():
                group.start_soon(write_or_tell, in_one_slot)
        if failures:
            raise failures[0]

    async def replicated(
        self, write: Callable[..., Awaitable[Any]], *, key: str | None = None
    ) -> Any:
        """``write(client=...)``; with ``wait_replicas``, on one connection followed by
        ``WAIT``, raising when fewer replicas than that have it within the deadline (on
        a cluster: on the master of ``key``'s slot, the prefix's by default, see
        :mod:`._redis_master`)."""
        transport = self.transport
        client = transport._redis()
        if not transport.wait_replicas:
            return await write(client=client)
        deadline = anyio.current_time() + transport.publish_timeout
        waited = functools.partial(self._waited, write, deadline=deadline)
        if transport.cluster:
            return await transport._master.on_master(
                client, waited, transport.publish_timeout, key=key
            )
        return await waited(client)

    async def _waited(
        self, write: Callable[..., Awaitable[Any]], client: Any, *, deadline: float
    ) -> Any:
        """``write`` and ``WAIT`` on one connection of ``client``'s server; the ``WAIT``
        takes at most 0.8 x ``publish_timeout`` and ends by ``deadline``."""
        transport = self.transport
        one = client.client()  # one connection: WAIT counts the writes made on it
        try:
            reply = await write(client=one)
            left = min(transport.publish_timeout * _WAIT_SHARE, deadline - anyio.current_time())
            wait_ms = max(1, int(left * 1000))
            acked = int(await one.wait(transport.wait_replicas, wait_ms))
        finally:
            with anyio.CancelScope(shield=True):
                await one.aclose(close_connection_pool=False)
        if acked < transport.wait_replicas:
            raise TransportError(
                f"Redis at {transport._shown()}: the publish is on the server but on {acked} "
                f"of the {transport.wait_replicas} replicas wait_replicas asks for "
                f"(after {wait_ms / 1000:g} s): it may be lost with the server"
            )
        return reply

    async def to_group(self, pattern: str, group: str, envelopes: Sequence[Envelope]) -> None:
        """XADD the envelopes to the stream of (``pattern``, ``group``) only."""
        transport = self.transport
        stream = transport.stream_key(pattern, group)
        if stream not in transport._bindings.bound:
            await transport._bindings.bind(pattern, group)
        args = [
            part for entry in (self.encode(envelope) for envelope in envelopes) for part in entry
        ]
        # One script call (atomic, and on the client's one connection: a pipeline takes
        # a connection of its own, which WAIT would not count).
        write = functools.partial(transport._scripts["ADD"], keys=[stream], args=args)

        try:
            await self.replicated(write, key=stream)
        except transport._errors.RedisError as error:
            raise transport._failed(f"publish to {pattern}@{group}", error) from error

    async def unrouted(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Store each envelope, which reached no group, as a ``no_subscribers`` dead letter."""
        transport = self.transport
        pipe = transport._redis().pipeline(transaction=True)
        for envelope in envelopes:
            transport._shared_dead.queue(pipe, unrouted_entry(envelope))
        try:
            with anyio.fail_after(transport.publish_timeout):
                await pipe.execute()
        except (transport._errors.RedisError, TimeoutError) as error:
            raise transport._failed(
                f"dead-lettering what {topic!r} reached no group", error
            ) from error
