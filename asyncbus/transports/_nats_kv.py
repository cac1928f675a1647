"""A JetStream key-value bucket of the NATS transport, made (again) on demand.

The transport keeps small records in KV buckets (``deduplicate()``'s claims, the
hand-backs of consumers that left). A bucket goes with the server's JetStream state (a
restart with its store lost) or with someone deleting it: then a write finds no
stream ("no responders") and a read no bucket. :meth:`KvBucket.call` makes it again
and runs the operation once more; what the bucket held is lost with it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from .._exceptions import TransportError

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = ["RACES", "KvBucket", "NatsHost", "change_at_revision"]


class NatsHost(Protocol):
    """What the NATS helpers use of their transport (:class:`~.nats.NatsTransport` is one)."""

    #: The name of the transport's stream of envelopes (buckets are named after it).
    stream: str
    #: Copies JetStream keeps of each bucket (the transport's ``replicas``).
    replicas: int

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connected client and its JetStream context."""
        ...


logger = logging.getLogger("asyncbus.transport.nats")

T = TypeVar("T")


class KvBucket:
    """The bucket ``name`` of ``transport``'s server; created at first use.

    :param ttl: seconds a key is kept after its last write.
    :param description: the bucket's description on the server.
    """

    def __init__(self, transport: NatsHost, name: str, *, ttl: float, description: str) -> None:
        self._transport = transport
        self.name = name
        self.ttl = ttl
        self.description = description
        self._kv: KeyValue | None = None
        self._kv_of: object = None

    async def _bucket(self) -> KeyValue:
        from nats.js.api import KeyValueConfig, StorageType

        _, js = self._transport._client()
        if self._kv is None or self._kv_of is not js:
            try:
                self._kv = await js.create_key_value(
                    KeyValueConfig(
                        bucket=self.name,
                        description=self.description,
                        ttl=self.ttl,
                        history=1,
                        storage=StorageType.FILE,
                        replicas=self._transport.replicas,
                    )
                )
            except Exception:
                self._kv = await js.key_value(self.name)  # made meanwhile by another
            self._kv_of = js
        return self._kv

    async def call_or_fail(self, operation: Callable[[KeyValue], Awaitable[T]], doing: str) -> T:
        """:meth:`call`, with nats-py's errors (and a timeout, a socket's error) raised as
        :class:`TransportError`: ``NATS: {doing} failed: ...``."""
        from nats.errors import Error as NatsError

        try:
            return await self.call(operation)
        except (NatsError, TimeoutError, OSError) as error:
            raise TransportError(
                f"NATS: {doing} failed: {type(error).__name__}: {error}"
            ) from error

    async def call(self, operation: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``operation`` on the bucket; a bucket that is gone is made again, once.

        :raises nats.errors.Error: what nats-py raises, for the operation to translate
            (a ``KeyNotFoundError`` is the operation's own to catch).
        """
        from nats.errors import NoRespondersError
        from nats.js.errors import (
            BucketNotFoundError,
            KeyNotFoundError,
            NoStreamResponseError,
            NotFoundError,
        )

        kv = await self._bucket()
        try:
            return await operation(kv)
        except (NoStreamResponseError, NoRespondersError, BucketNotFoundError) as error:
            gone: Exception = error
        except NotFoundError as error:  # the stream, not a key (operations catch those)
            if isinstance(error, KeyNotFoundError):
                raise
            gone = error
        logger.warning(
            "NATS: the bucket %s is gone (%s); making it again", self.name, type(gone).__name__
        )
        self._kv = None
        return await operation(await self._bucket())


#: Tries of a change that keeps meeting other processes' changes before giving up.
RACES = 50


async def change_at_revision(
    kv: KeyValue, key: str, change: Callable[[bytes | None], tuple[bytes | None, T]], doing: str
) -> T:
    """Read ``key``, let ``change`` make its new value from the value read (``None``: no
    key), and write it back at the revision read (``create`` for a new key), again when
    another process wrote first; ``change`` returns ``(new value or None to write
    nothing, the answer)``.

    :raises TransportError: after :data:`RACES` tries that each met another write.
    """
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    for _ in range(RACES):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            value, revision = None, None
        else:
            value, revision = entry.value, entry.revision
        written, answer = change(value)
        if written is None:
            return answer
        try:
            if revision is None:
                await kv.create(key, written)
            else:
                await kv.update(key, written, last=revision)
        except KeyWrongLastSequenceError:
            continue  # another process wrote meanwhile: again
        return answer
    raise TransportError(f"NATS: {doing}: {RACES} tries met other processes' writes")
