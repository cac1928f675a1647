"""The dead letters of :class:`~asyncbus.transports.postgres.PostgresTransport`: one
list in the database for every process, told of its changes.

Each insert notifies the schema's dead-letter channel with ``+<row>`` (a watcher reads
those rows), each removal with ``-<keys>`` (the removed entries' keys as JSON, or ``!``
when they would not fit a notification), and a purge or a restore with ``!`` (read the
whole store again). Removing is a ``DELETE ... RETURNING``: of concurrent removals of
one entry, exactly one gets it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from .._dead_letters import DeadLetter, dead_letter_key
from .._exceptions import DecodeError, TransportError
from ._codec import (
    dead_letter_from_wire,
    dead_letter_keys_from_wire,
    dead_letter_keys_to_wire,
    dead_letter_to_wire,
)
from .base import DeadLetterChange

if TYPE_CHECKING:
    from ._pg_common import PgHost

__all__ = ["STALE", "PgDeadLetters"]

logger = logging.getLogger("asyncbus.postgres")

#: The notification that says: read the whole store again.
STALE = "!"
#: The largest notification PostgreSQL takes is 8000 bytes; keys beyond are "read again".
_MOST_KEYS_BYTES = 7000
#: Notifications a watcher may be behind by before it is told to read everything again.
_WATCHER_BUFFER = 1000


class PgDeadLetters:
    """The dead-letter store of one transport (its methods are the transport's)."""

    def __init__(self, host: PgHost, channel: str) -> None:
        self._host = host
        #: The channel its notifications go to.
        self.channel = channel
        self._watchers: dict[MemoryObjectSendStream[str], bool] = {}

    # -- notifications ------------------------------------------------------------------

    def heard(self, payload: str) -> None:
        """A notification on the channel (the listening connection's callback)."""
        for watcher in self._watchers:
            try:
                watcher.send_nowait(payload)
            except anyio.WouldBlock:
                self._watchers[watcher] = True  # it missed some: it is told to read again
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    def missed(self) -> None:
        """Notifications may have been lost (the listening connection was): every
        watcher reads the store again."""
        self.heard(STALE)

    # -- the store ----------------------------------------------------------------------

    async def prune(self) -> None:
        """Drop dead letters past the bus's TTL or beyond its maxlen."""
        host = self._host
        await host.run(
            "pruning dead letters",
            "execute",
            host.sql.prune_dead_letters,
            time.time() - host.settings.dead_letter_ttl,
            host.settings.dead_letter_maxlen,
        )

    async def add(self, entry: DeadLetter) -> None:
        """Store one (and tell the watchers)."""
        host = self._host
        await host.run(
            "storing a dead letter",
            "execute",
            host.sql.add_dead_letter,
            entry.envelope.id,
            entry.dead_at,
            dead_letter_to_wire(entry, host.codec),
        )

    async def listed(self) -> list[DeadLetter]:
        """Every one kept, oldest first (expired and surplus ones dropped first)."""
        await self.prune()
        rows = await self._host.run("listing dead letters", "fetch", self._host.sql.dead_letters)
        return self._read(row[0] for row in rows)

    def _read(self, stored: Any) -> list[DeadLetter]:
        entries: list[DeadLetter] = []
        for data in stored:
            try:
                entries.append(dead_letter_from_wire(data, self._host.codec))
            except DecodeError as error:  # a row written by someone else
                logger.warning("PostgreSQL: an unreadable dead letter is skipped: %s", error)
        return entries

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Remove those of these envelope ids; the ones this call removed, oldest first."""
        if not ids:
            return []
        host = self._host
        rows = await host.run("taking dead letters", "fetch", host.sql.take_dead_letters, list(ids))
        taken = self._read(row[1] for row in sorted(rows, key=lambda row: row[0]))
        if rows:
            keys = dead_letter_keys_to_wire([dead_letter_key(entry) for entry in taken])
            said = "-" + keys.decode() if len(keys) <= _MOST_KEYS_BYTES else STALE
            if len(taken) < len(rows):
                said = STALE  # an unreadable one went too: its key is unknown
            try:
                await host.run("telling of dead letters taken", "execute", host.sql.tell, said)
            except TransportError as error:  # taken all the same: the caller has them
                logger.warning("%s (the other processes read their lists again later)", error)
        return taken

    async def clear(self) -> None:
        """Remove every one (the watchers read again)."""
        host = self._host
        await host.run("purging dead letters", "execute", host.sql.clear_dead_letters)

    async def restore(self, entries: Sequence[DeadLetter]) -> None:
        """Keep ``entries`` again (the watchers read again)."""
        if not entries:
            return
        host = self._host
        await host.run(
            "putting dead letters back",
            "executemany",
            host.sql.restore_dead_letter,
            [
                (entry.envelope.id, entry.dead_at, dead_letter_to_wire(entry, host.codec))
                for entry in entries
            ],
        )
        await host.run("telling of dead letters put back", "execute", host.sql.tell, STALE)

    # -- watching -----------------------------------------------------------------------

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every change from now on, as :class:`DeadLetterChange` values."""
        send, receive = anyio.create_memory_object_stream[str](_WATCHER_BUFFER)
        self._watchers[send] = False
        await self._host.listen()
        try:
            yield self._changes(send, receive)
        finally:
            self._watchers.pop(send, None)
            send.close()
            receive.close()

    async def _changes(
        self, send: MemoryObjectSendStream[str], receive: Any
    ) -> AsyncIterator[DeadLetterChange]:
        async for payload in receive:
            said = [payload]
            while True:  # what else is there already: one read for every addition
                try:
                    said.append(receive.receive_nowait())
                except anyio.WouldBlock:
                    break
            if self._watchers.get(send):
                self._watchers[send] = False
                said.append(STALE)
            for change in await self._changes_of(said):
                yield change

    async def _changes_of(self, said: list[str]) -> list[DeadLetterChange]:
        changes: list[DeadLetterChange] = []
        added: list[int] = []
        for payload in said:
            if payload.startswith("+") and payload[1:].isdigit():
                added.append(int(payload[1:]))
                continue
            if added:
                changes.append(await self._added(added))
                added = []
            if payload.startswith("-"):
                try:
                    changes.append(
                        DeadLetterChange(removed=dead_letter_keys_from_wire(payload[1:]))
                    )
                except DecodeError:
                    changes.append(DeadLetterChange(stale=True))
            else:
                changes.append(DeadLetterChange(stale=True))
        if added:
            changes.append(await self._added(added))
        return changes

    async def _added(self, rows: list[int]) -> DeadLetterChange:
        host = self._host
        found = await host.run(
            "reading dead letters added", "fetch", host.sql.dead_letters_at, rows
        )
        return DeadLetterChange(added=tuple(self._read(row[0] for row in found)))
