"""The NATS store of shared rate limits: a JetStream key-value bucket, one key per
rate-limit bucket holding its TAT.

A turn is read, computed and written back at the revision read (``update`` with
``last=``; ``create`` for a new key), again when another process moved first, so two
processes never take the same turn. The TAT is computed on this machine's clock: keep
the clocks of a group's machines in sync (a skew shifts turns by as much). Keys are
kept a day after their last write (a bucket idle longer starts full). See
:mod:`asyncbus._rates`.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import TYPE_CHECKING

import anyio

from .._rates import next_turns
from ._nats_kv import KvBucket, NatsHost, change_at_revision

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ["NatsRateStore"]

#: Seconds a bucket's key is kept after its last turn.
_KEPT = 86_400.0


def _tat(value: bytes | None) -> float | None:
    """A key's TAT; ``None`` (a new bucket) for a value this store did not write."""
    try:
        tat = float((value or b"").decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None
    return tat if math.isfinite(tat) else None


class _Turn:
    """One caller's turn, given by the write that took it."""

    __slots__ = ("error", "given", "wait")

    def __init__(self) -> None:
        self.given = anyio.Event()
        self.wait: float | None = None
        self.error: Exception | None = None


class NatsRateStore:
    """A :class:`~asyncbus._rates.RateStore` in a JetStream KV bucket.

    Made by :meth:`NatsTransport.rate_store`; the bucket is created at first use. The
    turns this process asks of one bucket while a write is under way are taken together
    by the next write (one round trip for all of them, so the processes' writes seldom
    meet), each caller its own turn, in the order asked.
    """

    def __init__(self, transport: NatsHost) -> None:
        self.bucket = f"{transport.stream}_RATES"
        self._kv = KvBucket(
            transport, self.bucket, ttl=_KEPT, description="asyncbus RateLimit turns"
        )
        #: Bucket -> turns asked and not yet written.
        self._waiting: dict[str, list[_Turn]] = {}
        #: Bucket -> the turns of the write under way (a caller of take() writes).
        self._writing: dict[str, list[_Turn]] = {}

    async def take(self, key: str, interval: float, burst: int) -> float:
        """Take the next turn of bucket ``key``: seconds until it is due."""
        while True:
            turn = _Turn()
            self._waiting.setdefault(key, []).append(turn)
            if key not in self._writing:
                await self._write_rounds(key, interval, burst)
            await turn.given.wait()
            if turn.error is not None:
                raise turn.error
            if turn.wait is not None:
                return turn.wait
            # the write of this turn was cut short (its writer cancelled): ask again

    async def _write_rounds(self, key: str, interval: float, burst: int) -> None:
        """Write the turns waiting for ``key``, a round at a time, until none is left."""
        self._writing[key] = []
        try:
            while waiting := self._waiting.pop(key, None):
                self._writing[key] = waiting
                try:
                    waits = await self._take_many(key, interval, burst, len(waiting))
                except Exception as error:
                    for turn in waiting:
                        turn.error = error
                        turn.given.set()
                else:
                    for turn, wait in zip(waiting, waits, strict=True):
                        turn.wait = wait
                        turn.given.set()
        finally:
            cut_short = self._writing.pop(key)
            for turn in cut_short + self._waiting.pop(key, []):
                turn.given.set()  # (unset ones: given nothing, they ask again)

    async def _take_many(self, key: str, interval: float, burst: int, count: int) -> list[float]:
        """``count`` turns of bucket ``key`` in one write: the seconds until each."""
        name = hashlib.sha256(key.encode()).hexdigest()[:40]
        doing = f"taking a turn of rate limit {key!r}"

        def turns(value: bytes | None) -> tuple[bytes, list[float]]:
            waits, after = next_turns(_tat(value), time.time(), interval, burst, count)
            return repr(after).encode(), waits

        async def take(kv: KeyValue) -> list[float]:
            return await change_at_revision(kv, name, turns, doing)

        return await self._kv.call_or_fail(take, doing)
