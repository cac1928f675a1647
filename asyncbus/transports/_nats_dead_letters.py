"""The NATS transport's dead letters as one list for every process: stored, claimed, watched.

Dead letters are messages of the stream ``{STREAM}_DLQ``, one subject per envelope id.
An entry's fields travel in a header, its payload as the body (encoded by the codec,
or the bytes as they were), so a dead letter is no bigger than the message it came
from; one over the server's ``max_payload`` is kept without its payload. Listing them
reads the stream with a short-lived consumer and drops what is past the TTL.
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

import dataclasses
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
from .._exceptions import DecodeError, EncodeError, TransportError
from ._codec import (
    Codec,
    RawBody,
    dead_letter_from_wire,
    dead_letter_keys_from_wire,
    dead_letter_keys_to_wire,
    dead_letter_to_wire,
)
from ._nats_client import broker_call
from ._nats_messages import header_size
from ._nats_subjects import id_token
from .base import DeadLetterChange

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext

    from .base import TransportSettings

__all__ = ["DeadLetterHost", "NatsDeadLetters"]

logger = logging.getLogger("asyncbus.transport.nats")

#: Header of a dead-letter message telling how its body holds the payload.
_HEADER_BODY = "asyncbus-body"
_HEADER_DEAD_LETTER = "asyncbus-dead-letter"
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

    dead_letter_stream: str
    codec: Codec
    request_timeout: float
    settings: TransportSettings

    def cleanup_scope(self, timeout: float = math.inf) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded scope, bounded by ``timeout`` and the close deadline."""
        ...

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connection and its JetStream context (:class:`TransportError` when closed)."""
        ...

    async def _restore(self) -> None:
        """Make the streams (and the transport's consumers) again."""
        ...


class NatsDeadLetters:
    """Claims and watching over the dead-letter stream of ``transport``."""

    def __init__(self, transport: DeadLetterHost, dead_prefix: str) -> None:
        self.transport = transport
        self.dead_prefix = dead_prefix
        self.dead_subjects = f"{dead_prefix}.>"
        self.changes_subject = f"{dead_prefix}_changes"
        self._watchers: set[MemoryObjectSendStream[DeadLetterChange]] = set()

    def subject(self, envelope_id: str) -> str:
        """The subject of the dead letters of ``envelope_id``."""
        return f"{self.dead_prefix}.{id_token(envelope_id)}"

    def horizon(self) -> float:
        """Epoch seconds before which a dead letter has expired."""
        return time.time() - self.transport.settings.dead_letter_ttl

    async def add(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter stream and wait for the ack.

        The entry's fields go in a header (:func:`dead_letter_to_wire` without the
        payload), the payload is the body as the codec encodes it, or raw when it is
        bytes, so a dead letter is no bigger than the message it came from (a
        :class:`RawBody`, a body that did not decode, is marked ``verbatim``: a replay
        sends it as it came).
        """
        transport = self.transport
        codec = transport.codec
        nc, js = transport._client()
        payload = entry.envelope.payload
        if isinstance(payload, bytes | bytearray):
            body, kind = bytes(payload), "verbatim" if type(payload) is RawBody else "raw"
        else:
            try:
                body, kind = codec.encode(payload), "codec"
            except EncodeError:
                body, kind = repr(payload).encode(), "raw"
        bare = dataclasses.replace(entry, envelope=entry.envelope.evolve(payload=None))
        headers = {
            _HEADER_DEAD_LETTER: dead_letter_to_wire(bare, codec).decode(),
            _HEADER_BODY: kind,
        }
        if len(body) + header_size(headers) > nc.max_payload:
            # Kept without its payload rather than lost (or redelivered forever).
            note = f"payload of {len(body)} bytes not kept: over the server's max_payload"
            bare = dataclasses.replace(
                bare, error=f"{entry.error}; {note}" if entry.error else note
            )
            headers = {
                _HEADER_DEAD_LETTER: dead_letter_to_wire(bare, codec).decode(),
                _HEADER_BODY: "dropped",
            }
            body = b""
        from nats.js.errors import NoStreamResponseError

        subject = self.subject(entry.envelope.id)
        with broker_call(f"cannot store the dead letter of {entry.envelope.id}"):
            try:
                await js.publish(subject, body, headers=headers)
            except NoStreamResponseError:
                logger.warning("NATS: no stream captures %s; making it again", subject)
                await transport._restore()
                await js.publish(subject, body, headers=headers)

    def entry_from(self, headers: Mapping[str, str] | None, data: bytes) -> DeadLetter | None:
        """The dead letter a message of the dead-letter stream holds (``None``: unreadable)."""
        codec = self.transport.codec
        headers = headers or {}
        try:
            entry = dead_letter_from_wire(headers[_HEADER_DEAD_LETTER].encode(), codec)
        except (KeyError, DecodeError):
            logger.warning(
                "skipping an unreadable dead letter in %s", self.transport.dead_letter_stream
            )
            return None
        kind = headers.get(_HEADER_BODY)
        payload: Any = None
        if kind == "verbatim":
            payload = RawBody(data)
        elif kind == "raw":
            payload = data
        elif kind == "codec":
            try:
                payload = codec.decode(data)
            except DecodeError:
                payload = data
        return dataclasses.replace(entry, envelope=entry.envelope.evolve(payload=payload))

    async def read(self) -> list[DeadLetter]:
        """Every dead letter in the stream, oldest first, without expired ones."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        transport = self.transport
        stream = transport.dead_letter_stream
        nc, js = transport._client()
        with broker_call(f"cannot read the dead-letter stream {stream}"):
            info = await js.stream_info(stream)
        if not info.state.messages:
            return []
        last = info.state.last_seq
        reader = f"reader-{nc.new_inbox().rpartition('.')[2]}"
        config = ConsumerConfig(
            name=reader,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        entries: list[DeadLetter] = []
        with broker_call(f"cannot read the dead-letter stream {stream}"):
            await js.add_consumer(stream, config)
            try:
                pull = await js.pull_subscribe_bind(durable=reader, stream=stream)
                try:
                    remaining = info.state.messages
                    while remaining > 0:
                        try:
                            msgs = await pull.fetch(
                                min(remaining, 256), timeout=transport.request_timeout
                            )
                        except NatsTimeout:
                            break
                        for msg in msgs:
                            entry = self.entry_from(msg.headers, msg.data)
                            if entry is not None:
                                entries.append(entry)
                        metadata = msgs[-1].metadata
                        if metadata.sequence.stream >= last or not metadata.num_pending:
                            break
                        remaining = metadata.num_pending
                finally:
                    with anyio.CancelScope(shield=True):
                        await pull.unsubscribe()
            finally:
                with anyio.CancelScope(shield=True):
                    await js.delete_consumer(stream, reader)
        settings = transport.settings
        horizon = time.time() - settings.dead_letter_ttl
        entries = [entry for entry in entries if entry.dead_at > horizon]
        if settings.dead_letter_maxlen > 0:
            del entries[: max(0, len(entries) - settings.dead_letter_maxlen)]
        return entries

    async def clear(self) -> None:
        """Purge the dead-letter stream (every watcher reads it again)."""
        stream = self.transport.dead_letter_stream
        _, js = self.transport._client()
        with broker_call(f"cannot purge the dead-letter stream {stream}"):
            await js.purge_stream(stream)
        await self.stale()

    async def put_back(self, entries: Sequence[DeadLetter]) -> None:
        """Store ``entries`` again (taken for a replay that failed); every watcher reads
        the dead letters again."""
        for entry in entries:
            await self.add(entry)
        await self.stale()

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the messages of ``ids``; the entries this call deleted, oldest first."""
        transport = self.transport
        nc, js = transport._client()
        stream = transport.dead_letter_stream
        horizon = self.horizon()
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

        for envelope_id in dict.fromkeys(ids):
            subject = self.subject(envelope_id)
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
                entry = self.entry_from(message.headers, message.data or b"")
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
            entry = self.entry_from(msg.headers, msg.data)
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
