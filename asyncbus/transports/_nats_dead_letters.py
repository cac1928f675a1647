"""The NATS transport's dead letters as one list for every process: claims and watching.

Dead letters are messages of the stream ``{STREAM}_DLQ``, one subject per envelope id.
Taking one out (a replay, a purge) finds each message of the id's subject
(``STREAM.MSG.GET`` with ``next_by_subj``) and deletes it by its sequence: the server
deletes a sequence once, so of processes taking it at once exactly one gets it. What
went is announced on the core subject ``{prefix}_dlq_changes`` (the keys, as JSON), as
is ``"stale"`` when every list should be read again (everything purged, entries put
back). A watcher subscribes to that subject and to the dead letters' own subjects (a
plain subscriber gets every message published to them, as the stream does); what it
may have missed while the connection was down makes it read everything again. A key
removed is remembered for a while, so a message of its entry that the client hands
over after the removal (the two subscriptions are two queues) does not bring it back.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from .._dead_letters import DeadLetter, DeadLetterKey, dead_letter_key
from .._exceptions import DecodeError, TransportError
from ._codec import dead_letter_keys_from_wire, dead_letter_keys_to_wire
from ._nats_consumer import broker_call
from .base import DeadLetterChange

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

__all__ = ["DeadLetterHost", "NatsDeadLetters"]

logger = logging.getLogger("asyncbus.transports.nats")

#: JetStream's error codes for a message that is not there (any more): "no message
#: found" (a get, or a delete racing another) and "sequence not found".
_GONE = frozenset({10037, 10043, 10057})
#: The body of a change that says: read every dead letter again.
_STALE = b'"stale"'
#: Keys of removed entries a watcher remembers, and for how long (seconds).
_REMEMBERED = 10_000
_REMEMBERED_FOR = 60.0


#: Seconds leaving a watch may take to unsubscribe (never past the close deadline).
_UNSUBSCRIBE_TIMEOUT = 1.0


class DeadLetterHost(Protocol):
    """What the dead letters use of their transport (:class:`~.nats.NatsTransport`)."""

    prefix: str
    dead_letter_stream: str

    def cleanup_scope(self, timeout: float = math.inf) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded scope, bounded by ``timeout`` and the close deadline."""
        ...

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connection and its JetStream context (:class:`TransportError` when closed)."""
        ...

    def dead_letter_subject(self, envelope_id: str) -> str:
        """The subject of the dead letters of ``envelope_id``."""
        ...

    def dead_letter_from(self, headers: Mapping[str, str] | None, data: bytes) -> DeadLetter | None:
        """The dead letter a message of the stream holds (``None``: unreadable)."""
        ...

    def dead_letter_horizon(self) -> float:
        """Epoch seconds before which a dead letter has expired."""
        ...

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Store ``entry`` in the stream."""
        ...


class NatsDeadLetters:
    """Claims and watching over the dead-letter stream of ``transport``."""

    def __init__(self, transport: DeadLetterHost, dead_prefix: str) -> None:
        self.transport = transport
        self.dead_subjects = f"{dead_prefix}.>"
        self.changes_subject = f"{dead_prefix}_changes"
        self._watchers: set[MemoryObjectSendStream[DeadLetterChange]] = set()

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the messages of ``ids``; the entries this call deleted, oldest first."""
        transport = self.transport
        nc, js = transport._client()
        stream = transport.dead_letter_stream
        horizon = transport.dead_letter_horizon()
        taken: list[tuple[int, DeadLetter]] = []
        removed: list[DeadLetterKey] = []
        try:
            with broker_call("cannot take dead letters"):
                await self._take(ids, js, stream, horizon, taken, removed)
        except TransportError as error:
            if not taken:
                raise
            # Deleted one by one: what was deleted before the failure is this call's
            # (the caller re-sends it, or puts it back), never lost.
            logger.warning("NATS: taking dead letters stopped half-way: %s", error)
        if removed:
            with broker_call("cannot announce a change of the dead letters"):
                await nc.publish(self.changes_subject, dead_letter_keys_to_wire(removed))
        return [entry for _, entry in sorted(taken, key=lambda found: found[0])]

    async def _take(
        self,
        ids: Sequence[str],
        js: JetStreamContext,
        stream: str,
        horizon: float,
        taken: list[tuple[int, DeadLetter]],
        removed: list[DeadLetterKey],
    ) -> None:
        from nats.js.errors import APIError, NotFoundError

        transport = self.transport
        for envelope_id in dict.fromkeys(ids):
            subject = transport.dead_letter_subject(envelope_id)
            sequence = 1
            while True:
                try:
                    message = await js.get_msg(stream, seq=sequence, subject=subject, next=True)
                except NotFoundError:
                    break  # no more
                sequence = (message.seq or sequence) + 1
                try:
                    await js.delete_msg(stream, message.seq or 0)
                except APIError as error:
                    if error.err_code in _GONE:
                        continue  # deleted meanwhile: another process took it
                    raise
                entry = transport.dead_letter_from(message.headers, message.data or b"")
                if entry is None or entry.dead_at <= horizon:
                    continue  # unreadable or expired: removed, never replayed
                taken.append((message.seq or 0, entry))
                removed.append(dead_letter_key(entry))

    async def stale(self) -> None:
        """Tell every watcher to read the dead letters again."""
        nc, _ = self.transport._client()
        with broker_call("cannot announce a change of the dead letters"):
            await nc.publish(self.changes_subject, _STALE)

    def reconnected(self) -> None:
        """The connection came back: what was published meanwhile was missed."""
        for watcher in list(self._watchers):
            watcher.send_nowait(DeadLetterChange(stale=True))

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every change from now on (see the module's docstring)."""
        nc, _ = self.transport._client()
        send, receive = anyio.create_memory_object_stream[DeadLetterChange](math.inf)
        removed: OrderedDict[DeadLetterKey, float] = OrderedDict()

        def forget_old() -> None:
            horizon = time.monotonic() - _REMEMBERED_FOR
            while removed and (
                len(removed) > _REMEMBERED or next(iter(removed.values())) < horizon
            ):
                removed.popitem(last=False)

        async def added(msg: Msg) -> None:
            entry = self.transport.dead_letter_from(msg.headers, msg.data)
            if entry is not None and dead_letter_key(entry) not in removed:
                send.send_nowait(DeadLetterChange(added=(entry,)))

        async def changed(msg: Msg) -> None:
            if msg.data == _STALE:
                send.send_nowait(DeadLetterChange(stale=True))
                return
            try:
                keys = dead_letter_keys_from_wire(msg.data)
            except DecodeError as error:
                logger.warning("NATS: unreadable removal of dead letters: %s", error)
                send.send_nowait(DeadLetterChange(stale=True))
                return
            forget_old()
            now = time.monotonic()
            for key in keys:
                removed[key] = now
            send.send_nowait(DeadLetterChange(removed=keys))

        subscriptions: list[Any] = []
        try:
            with broker_call("cannot watch the dead letters"):
                subscriptions.append(await nc.subscribe(self.dead_subjects, cb=added))
                subscriptions.append(await nc.subscribe(self.changes_subject, cb=changed))
                await nc.flush()  # the server has them before the store is read
            self._watchers.add(send)
            async with receive:
                yield receive
        finally:
            self._watchers.discard(send)
            send.close()
            receive.close()  # (when setting up failed: never handed out)
            with self.transport.cleanup_scope(_UNSUBSCRIBE_TIMEOUT):
                for subscription in subscriptions:
                    try:
                        await subscription.unsubscribe()
                    except Exception as error:  # a closed connection took them already
                        logger.debug("NATS: unsubscribing failed: %s", error)
