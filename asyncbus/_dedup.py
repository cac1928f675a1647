"""Where ``deduplicate()`` keeps the ids it handles: the store protocol and the in-memory one.

A handling goes through three steps, each one call on the store:

1. ``claim(key, owner, lease)``: the key (a stage and an envelope id) is free, so it
   is the owner's for ``lease`` seconds (:attr:`Claim.CLAIMED`); or it was handled
   already (:attr:`Claim.DONE`: skip it); or another owner holds a live claim
   (:attr:`Claim.BUSY`: ask again later). While handling, the owner ``extend``\\ s the
   lease; an owner that dies stops extending, and its claim expires, so the
   redelivery of its work runs elsewhere.
2. The handler runs.
3. ``done(key, owner, ttl)`` once it succeeded: the key is remembered as handled for
   ``ttl`` seconds; or ``release(key, owner)`` when it failed, so a retry or a
   redelivery runs it again.

Stores for brokers (``transport.dedup_store(window)``) keep this in the broker, so
every process of a group shares it; :class:`MemoryDedupStore` keeps it in this
process. Any object with these four coroutines is a store (a table in Postgres, say).
"""

from __future__ import annotations

from collections import OrderedDict
from enum import StrEnum
from typing import Protocol, runtime_checkable

import anyio

from ._clock import Clock

__all__ = ["TICK_KEY_PREFIX", "Claim", "DedupStore", "MemoryDedupStore"]

#: Where the keys of periodic ticks begin (``{prefix}{schedule name}/{tick ms}``, and
#: ``{prefix}{schedule name}/known``).
TICK_KEY_PREFIX = "_asyncbus.periodic."


class Claim(StrEnum):
    """What :meth:`DedupStore.claim` found."""

    #: The key is the caller's now: handle, then ``done`` or ``release``.
    CLAIMED = "claimed"
    #: Handled before (within the window): skip it.
    DONE = "done"
    #: Another owner holds a live claim: it is being handled; ask again later.
    BUSY = "busy"


@runtime_checkable
class DedupStore(Protocol):
    """Shared memory of handled envelopes for :func:`asyncbus.middleware.deduplicate`.

    Keys are strings (a stage name and an envelope id); owners are random tokens, one
    per handling. Every method may raise; ``deduplicate()`` treats a failed ``claim``
    as a failed attempt (the retry policy sees it) and a failed ``done``/``release``
    as a lost mark (logged; the claim expires after its lease).
    """

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """Claim ``key`` for ``owner`` for ``lease`` seconds, unless done or claimed."""
        ...

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep ``owner``'s claim ``lease`` more seconds; ``False`` if it is not held."""
        ...

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Remember ``key`` as handled for ``ttl`` seconds (whoever holds it now)."""
        ...

    async def release(self, key: str, owner: str) -> None:
        """Forget ``owner``'s claim of ``key`` (another owner's claim is left alone)."""
        ...


class MemoryDedupStore:
    """A :class:`DedupStore` in this process's memory (one process's handlings only).

    Leases and ``ttl`` are measured with the running event loop's clock, as every
    duration the bus decides on (a test's mock clock drives them).

    :param maxlen: keys remembered at most; the oldest are forgotten first.
    :param clock: seconds, monotonic; by default the loop's clock of the calling task.
    """

    def __init__(self, *, maxlen: int = 100_000, clock: Clock | None = None) -> None:
        self.maxlen = maxlen
        self._clock: Clock = anyio.current_time if clock is None else clock
        #: key -> (owner, or "" once done; expiry on the clock)
        self._keys: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def _live(self, key: str, now: float) -> tuple[str, float] | None:
        found = self._keys.get(key)
        if found is not None and found[1] <= now:
            del self._keys[key]
            return None
        return found

    def _set(self, key: str, owner: str, until: float) -> None:
        self._keys[key] = (owner, until)
        self._keys.move_to_end(key)
        while len(self._keys) > self.maxlen:
            self._keys.popitem(last=False)

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        """Claim ``key`` for ``owner`` for ``lease`` seconds, unless done or claimed."""
        now = self._clock()
        found = self._live(key, now)
        if found is None or found[0] == owner:
            self._set(key, owner, now + lease)
            return Claim.CLAIMED
        return Claim.DONE if found[0] == "" else Claim.BUSY

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        """Keep ``owner``'s claim ``lease`` more seconds; ``False`` if it is not held."""
        now = self._clock()
        found = self._live(key, now)
        if found is None or found[0] != owner:
            return False
        self._set(key, owner, now + lease)
        return True

    async def done(self, key: str, owner: str, ttl: float) -> None:
        """Remember ``key`` as handled for ``ttl`` seconds."""
        self._set(key, "", self._clock() + ttl)

    async def release(self, key: str, owner: str) -> None:
        """Forget ``owner``'s claim of ``key``."""
        found = self._live(key, self._clock())
        if found is not None and found[0] == owner:
            del self._keys[key]
