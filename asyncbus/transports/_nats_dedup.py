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
again at its next use (:mod:`._nats_kv`); what it remembered is lost with it.
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
from .._exceptions import DecodeError
from ._nats_kv import KvBucket, NatsHost
from ._wire_fields import real

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

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


async def _same(kv: KeyValue) -> KeyValue:
    return kv


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

    def __init__(self, transport: NatsHost, window: float) -> None:
        self.window = window
        self.bucket = f"{transport.stream}_DEDUP_{math.ceil(window)}"
        self._kv = KvBucket(
            transport,
            self.bucket,
            ttl=window,
            description="asyncbus deduplicate() claims and handled ids",
        )

    async def _bucket(self) -> KeyValue:
        """The bucket, made if need be (for tests and tools)."""
        return await self._kv.call(_same)

    async def _call(self, key: str, operation: Callable[[KeyValue], Awaitable[T]]) -> T:
        """``operation`` on the bucket (made again if it is gone); nats-py's errors
        become :class:`TransportError`."""
        return await self._kv.call_or_fail(operation, f"deduplicating {key!r}")

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
