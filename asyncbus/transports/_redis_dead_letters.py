"""The Redis transport's dead letters as one list for every process: stored, listed,
claimed and watched.

The entries are the stream ``{prefix}:deadletters`` (``id``, ``entry`` fields), trimmed
to the store's size as they are added and to its TTL as they are listed. Taking
one out (a replay, a purge) is a script that deletes each entry it finds (``XDEL`` says
whether this call deleted it: the claim) and, for what it deleted, adds a removal to
the stream ``{prefix}:deadletters:removed`` (``n``, ``keys``), ``n`` counting removals
in ``{prefix}:deadletters:removals``. A watcher reads both streams with one blocking
``XREAD``: new entries are additions, removals name the keys that went; a removal whose
``n`` is not the one after the last (some were trimmed unread, or Redis lost its data)
makes the watcher read everything again, as does a purge of everything (or entries put
back after a replay that failed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

from .._dead_letters import DeadLetter, dead_letter_key
from .._exceptions import DecodeError, TransportError
from ._codec import (
    Codec,
    dead_letter_from_wire,
    dead_letter_keys_from_wire,
    dead_letter_keys_to_wire,
    dead_letter_to_wire,
)
from ._redis_dedup import RedisHost
from .base import DeadLetterChange, TransportSettings

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["DeadLetterHost", "RedisDeadLetters"]


class DeadLetterHost(RedisHost, Protocol):
    """What the dead letters use of their transport (:class:`~.redis.RedisTransport`)."""

    settings: TransportSettings
    codec: Codec
    #: How long one blocking read waits (ms).
    block_ms: int
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]


logger = logging.getLogger("asyncbus.transport.redis")

#: Removals kept for watchers that fall behind (more missed makes them read everything).
_REMOVALS_KEPT = 10_000
#: Entries one read of a watcher takes at most.
_WATCH_COUNT = 1000
#: Entries one read of a listing takes at most.
_PAGE = 1000


class RedisDeadLetters:
    """The dead-letter stream of ``transport``: entries added, listed, claimed, watched."""

    def __init__(self, transport: DeadLetterHost, dead_key: str) -> None:
        self.transport = transport
        self.dead_key = dead_key
        self.removed_key = f"{dead_key}:removed"
        self.count_key = f"{dead_key}:removals"

    def _xadd(
        self, entry: DeadLetter, codec: Codec | None
    ) -> tuple[tuple[str, dict[str, Any]], dict[str, Any]] | None:
        """The arguments of the XADD of ``entry`` (``None``: a store of size 0 keeps
        nothing)."""
        transport = self.transport
        if transport.settings.dead_letter_maxlen <= 0:
            return None
        document = dead_letter_to_wire(entry, codec or transport.codec)
        fields: dict[str, Any] = {"id": entry.envelope.id, "entry": document}
        options = {"maxlen": transport.settings.dead_letter_maxlen, "approximate": True}
        return (self.dead_key, fields), options

    def queue(self, pipe: Any, entry: DeadLetter, codec: Codec | None = None) -> None:
        """Add the XADD of ``entry`` to ``pipe`` (its payload encoded by ``codec``, the
        transport's by default)."""
        call = self._xadd(entry, codec)
        if call is not None:
            pipe.xadd(*call[0], **call[1])

    async def add_on(self, client: Any, entry: DeadLetter, codec: Codec | None = None) -> None:
        """Append ``entry`` with ``client`` (one command: on one connection, which a
        ``WAIT`` after it counts); see :meth:`queue`."""
        call = self._xadd(entry, codec)
        if call is not None:
            await client.xadd(*call[0], **call[1])

    async def add(self, entry: DeadLetter) -> None:
        """Append ``entry`` to the stream."""
        transport = self.transport
        pipe = transport._redis().pipeline(transaction=False)
        self.queue(pipe, entry)
        try:
            await pipe.execute()
        except transport._errors.RedisError as error:
            raise transport._failed("adding a dead letter", error) from error

    async def _entries(self) -> AsyncIterator[tuple[bytes, dict[bytes, bytes]]]:
        """Every entry of the stream, oldest first, in pages."""
        client = self.transport._redis()
        start: bytes | str = "-"
        while True:
            page: Any = await client.xrange(self.dead_key, min=start, max="+", count=_PAGE)
            for entry, fields in page:
                yield entry, fields
            if len(page) < _PAGE:
                return
            start = b"(" + page[-1][0]

    async def read(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        transport = self.transport
        client = transport._redis()
        horizon = time.time() - transport.settings.dead_letter_ttl
        try:
            pipe = client.pipeline(transaction=True)
            pipe.xtrim(self.dead_key, minid=int(horizon * 1000), approximate=False)
            pipe.xtrim(
                self.dead_key,
                maxlen=max(transport.settings.dead_letter_maxlen, 0),
                approximate=False,
            )
            await pipe.execute()
            found: list[DeadLetter] = []
            expired: list[bytes] = []
            async for entry, fields in self._entries():
                try:
                    dead = dead_letter_from_wire(fields.get(b"entry", b""), transport.codec)
                except DecodeError as error:
                    logger.warning("Redis: skipping unreadable dead letter %r: %s", entry, error)
                    continue
                if dead.dead_at <= horizon:
                    expired.append(entry)
                else:
                    found.append(dead)
            if expired:
                await client.xdel(self.dead_key, *expired)
        except transport._errors.RedisError as error:
            raise transport._failed("listing dead letters", error) from error
        return found

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the entries of ``ids``; the ones this call deleted, oldest first."""
        if not ids:
            return []
        transport = self.transport
        transport._redis()  # not connected: TransportError, before any redis error
        drop = {id.encode() for id in ids}
        horizon = time.time() - transport.settings.dead_letter_ttl
        found: dict[bytes, DeadLetter | None] = {}
        arguments: list[Any] = [_REMOVALS_KEPT]
        try:
            async for entry, fields in self._entries():
                if fields.get(b"id") not in drop:
                    continue
                try:
                    dead = dead_letter_from_wire(fields.get(b"entry", b""), transport.codec)
                except DecodeError:
                    dead = None  # unreadable: removed, never replayed
                if dead is not None and dead.dead_at <= horizon:
                    dead = None  # expired: no longer listed
                found[entry] = dead
                # (Its key, as one JSON array; none for what no watcher lists.)
                key = dead_letter_keys_to_wire([dead_letter_key(dead)])[1:-1] if dead else b""
                arguments += [entry, key]
            if not found:
                return []
            taken = await transport._scripts["TAKE_DEAD"](
                keys=[self.dead_key, self.removed_key, self.count_key], args=arguments
            )
        except transport._errors.RedisError as error:
            raise transport._failed("taking dead letters", error) from error
        return [dead for entry in taken if (dead := found.get(entry)) is not None]

    async def restore(self, entries: Sequence[DeadLetter]) -> None:
        """Append ``entries`` again; every watcher reads the store again."""
        transport = self.transport
        pipe = transport._redis().pipeline(transaction=True)
        for entry in entries:
            self.queue(pipe, entry)
        try:
            await pipe.execute()
            await transport._scripts["STALE_DEAD"](
                keys=[self.dead_key, self.removed_key, self.count_key], args=[_REMOVALS_KEPT]
            )
        except transport._errors.RedisError as error:
            raise transport._failed("storing dead letters again", error) from error

    async def clear(self) -> None:
        """Delete every dead letter; every watcher reads the store again."""
        transport = self.transport
        transport._redis()
        try:
            await transport._scripts["CLEAR_DEAD"](
                keys=[self.dead_key, self.removed_key, self.count_key], args=[_REMOVALS_KEPT]
            )
        except transport._errors.RedisError as error:
            raise transport._failed("clearing dead letters", error) from error

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every change from now on (see the module's docstring)."""
        transport = self.transport
        client = transport._redis()
        try:
            pipe = client.pipeline(transaction=True)
            pipe.xrevrange(self.dead_key, count=1)
            pipe.xrevrange(self.removed_key, count=1)
            pipe.get(self.count_key)
            last_entry, last_removal, count = await pipe.execute()
        except transport._errors.RedisError as error:
            raise transport._failed("watching dead letters", error) from error
        changes = self._changes(
            last_entry[0][0] if last_entry else b"0-0",
            last_removal[0][0] if last_removal else b"0-0",
            _count(count),
        )
        try:
            yield changes
        finally:
            await changes.aclose()  # type: ignore[attr-defined]

    async def _changes(
        self, entries_from: bytes, removals_from: bytes, count: int | None
    ) -> AsyncIterator[DeadLetterChange]:
        transport = self.transport
        while True:
            client = transport._redis()
            try:
                reply: Any = await client.xread(
                    {self.dead_key: entries_from, self.removed_key: removals_from},
                    count=_WATCH_COUNT,
                    block=transport.block_ms,
                )
            except transport._errors.RedisError as error:
                raise transport._failed("watching dead letters", error) from error
            for stream, items in _streams(reply):
                if not items:
                    continue
                if stream == self.dead_key.encode():
                    entries_from = items[-1][0]
                    added = tuple(self._readable(items))
                    if added:
                        yield DeadLetterChange(added=added)
                    continue
                removals_from = items[-1][0]
                for _, fields in items:
                    number = _count(fields.get(b"n"))
                    stale = count is None or number != count + 1 or b"all" in fields
                    count = number
                    if stale:
                        yield DeadLetterChange(stale=True)
                        continue
                    try:
                        keys = dead_letter_keys_from_wire(fields.get(b"keys", b""))
                    except DecodeError as error:
                        logger.warning("Redis: unreadable removal of dead letters: %s", error)
                        yield DeadLetterChange(stale=True)
                        continue
                    yield DeadLetterChange(removed=keys)

    def _readable(self, items: list[tuple[bytes, dict[bytes, bytes]]]) -> list[DeadLetter]:
        found: list[DeadLetter] = []
        for entry, fields in items:
            try:
                found.append(dead_letter_from_wire(fields.get(b"entry", b""), self.transport.codec))
            except DecodeError as error:
                logger.warning("Redis: skipping unreadable dead letter %r: %s", entry, error)
        return found


def _count(value: Any) -> int | None:
    """A removal count as Redis holds it (``None``: none yet, or not a count)."""
    try:
        return int(value) if value is not None else 0
    except (TypeError, ValueError):
        return None


def _streams(reply: Any) -> list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """``XREAD``'s reply as (stream, entries) pairs, whichever protocol answered."""
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3: {stream: [entries]}
        return [
            (_bytes(stream), list(value[0]) if value else []) for stream, value in reply.items()
        ]
    return [(_bytes(stream), list(items or ())) for stream, items in reply]


def _bytes(value: bytes | str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, bytes):
        raise TransportError(f"Redis: unexpected stream name {value!r}")
    return value
