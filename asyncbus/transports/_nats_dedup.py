"""The NATS store of ``deduplicate()``: a JetStream key-value bucket, one key per handling.

The stream's ``Nats-Msg-Id`` window drops a second *publish* of an id; handling needs
more (a claim before, a mark after), so the store is a KV bucket
``{stream}_DEDUP_{window}`` whose age limit is the window. A key (a hash of the stage,
then the envelope id) holds ``{"owner": ..., "until": epoch seconds}`` while claimed
and ``{"done": true}`` once handled. Claiming is ``create`` (refused when the key
exists) or, for an expired claim, ``update`` at the revision read (refused when
someone else moved first), so two processes never both claim it. A claim's expiry is
compared with this machine's clock: keep the clocks of a group's machines in sync
(a skew shortens or lengthens a dead owner's lease by as much). A bucket that is gone
(a server restarted with its JetStream state lost, or someone deleted it) is made
again at its next use; what it remembered is lost with it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .._dedup import Claim
from .._exceptions import DecodeError, TransportError
from ._wire_fields import real

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from .nats import NatsTransport

__all__ = ["NatsDedupStore"]

logger = logging.getLogger("asyncbus.transport.nats")

T = TypeVar("T")

_DONE = b'{"done":true}'
#: Tries of a claim that keeps meeting concurrent changes before calling it busy.
_RACES = 5


def _key(key: str) -> str:
    """A KV key (letters, digits, ``-_=.`` only) for a store key ``stage/id``."""
    stage, _, envelope_id = key.rpartition("/")
    digest = hashlib.sha256(stage.encode()).hexdigest()[:16]
    if envelope_id and all(c.isascii() and (c.isalnum() or c in "-_=") for c in envelope_id):
        return f"{digest}.{envelope_id}"
    return f"{digest}.h{hashlib.sha256(envelope_id.encode()).hexdigest()[:40]}"


def _parse(value: bytes | None) -> dict[str, Any]:
    """A key's value; ``{}`` (no claim, not done) for one this store did not write.

    Another client may have written anything there (not JSON, JSON nested deeper than
    any parser recurses, an ``until`` that is no number): such a key is taken over.
    """
    data = value or b""
    try:
        found = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        found = None
    if isinstance(found, dict):
        if found.get("done") is True:
            return {"done": True}
        owner, until = found.get("owner"), found.get("until")
        if type(owner) is str and type(until) in (int, float):
            try:
                return {"owner": owner, "until": real(until, "until")}
            except DecodeError:
                pass
    logger.warning("NATS: deduplicate(): ignoring an unreadable claim %r", data[:80])
    return {}


class NatsDedupStore:
    """A :class:`~asyncbus.middleware.deduplicate.DedupStore` in a JetStream KV bucket.

    Made by :meth:`NatsTransport.dedup_store`; the bucket is created at first use.
    """

    def __init__(self, transport: NatsTransport, window: float) -> None:
        self._transport = transport
        self.window = window
        self.bucket = f"{transport.stream}_DEDUP_{math.ceil(window)}"
        self._kv: KeyValue | None = None
        self._kv_of: object = None

    async def _bucket(self) -> KeyValue:
        from nats.js.api import KeyValueConfig, StorageType

        _, js = self._transport._client()
        if self._kv is None or self._kv_of is not js:
            try:
                self._kv = await js.create_key_value(
                    KeyValueConfig(
                        bucket=self.bucket,
                        description="asyncbus deduplicate() claims and handled ids",
                        ttl=self.window,
                        history=1,
                        storage=StorageType.FILE,
                    )
                )
            except Exception:
                self._kv = await js.key_value(self.bucket)  # made meanwhile by another
            self._kv_of = js
        return self._kv

    def _failed(self, key: str, error: BaseException) -> TransportError:
        return TransportError(
            f"NATS: deduplicating {key!r} failed: {type(error).__name__}: {error}"
        )

    async def _call(self, key: str, operation: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``operation`` on the bucket; a bucket that is gone is made again, once.

        The bucket goes with the server's JetStream state (a restart with its store
        lost) or with someone deleting it: then a write finds no stream ("no
        responders") and a read no bucket. What it remembered is lost with it; the
        claims made from now on are kept again.
        """
        from nats.errors import Error as NatsError
        from nats.errors import NoRespondersError
        from nats.js.errors import (
            BucketNotFoundError,
            KeyNotFoundError,
            NoStreamResponseError,
            NotFoundError,
        )

        try:
            for attempt in (1, 2):
                kv = await self._bucket()
                try:
                    return await operation(kv)
                except (NoStreamResponseError, NoRespondersError, BucketNotFoundError) as error:
                    gone: Exception = error
                except NotFoundError as error:  # the stream, not a key (operations catch those)
                    if isinstance(error, KeyNotFoundError):
                        raise
                    gone = error
                if attempt == 2:
                    raise gone
                logger.warning(
                    "NATS: the deduplicate() bucket %s is gone (%s); making it again",
                    self.bucket,
                    type(gone).__name__,
                )
                self._kv = None
        except (NatsError, TimeoutError, OSError) as error:
            raise self._failed(key, error) from error
        raise AssertionError("unreachable")  # pragma: no cover

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """Claim ``key`` for ``owner`` for ``lease`` seconds, unless done or claimed."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        name = _key(key)

        async def claim(kv: KeyValue) -> Claim:
            mine = json.dumps({"owner": owner, "until": time.time() + lease}).encode()
            for _ in range(_RACES):
                try:
                    await kv.create(name, mine)
                    return Claim.CLAIMED
                except KeyWrongLastSequenceError:
                    pass  # the key exists: look at it
                try:
                    entry = await kv.get(name)
                except KeyNotFoundError:
                    continue  # gone meanwhile (released, expired): create again
                found = _parse(entry.value)
                if found.get("done"):
                    return Claim.DONE
                if found.get("owner") != owner and found.get("until", 0.0) > time.time():
                    return Claim.BUSY
                try:  # an expired claim (its owner died), or our own: take it over
                    await kv.update(name, mine, last=entry.revision)
                    return Claim.CLAIMED
                except KeyWrongLastSequenceError:
                    continue
            return Claim.BUSY

        return await self._call(key, claim)

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep ``owner``'s claim ``lease`` more seconds; ``False`` if it is not held."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        name = _key(key)

        async def extend(kv: KeyValue) -> bool:
            try:
                entry = await kv.get(name)
                if _parse(entry.value).get("owner") != owner:
                    return False
                mine = json.dumps({"owner": owner, "until": time.time() + lease}).encode()
                await kv.update(name, mine, last=entry.revision)
            except (KeyNotFoundError, KeyWrongLastSequenceError):
                return False
            return True

        return await self._call(key, extend)

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Remember ``key`` as handled (for the bucket's age limit, the window)."""

        async def done(kv: KeyValue) -> None:
            await kv.put(_key(key), _DONE)

        await self._call(key, done)

    async def release(self, key: str, owner: str) -> None:
        """Forget ``owner``'s claim of ``key``."""
        from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

        name = _key(key)

        async def release(kv: KeyValue) -> None:
            try:
                entry = await kv.get(name)
                if _parse(entry.value).get("owner") == owner:
                    await kv.delete(name, last=entry.revision)
            except (KeyNotFoundError, KeyWrongLastSequenceError):
                return

        await self._call(key, release)
