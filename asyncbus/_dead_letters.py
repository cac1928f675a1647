"""The dead-letter queue: where envelopes that could not be handled wait for a person."""

from __future__ import annotations

import builtins
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from ._envelope import Envelope, Receipt

__all__ = ["DEADLETTER_TOPIC", "DeadLetter", "DeadLetterQueue", "DeadLetterReason"]

#: Topic on which every new dead letter is published, as a :class:`DeadLetter` payload.
DEADLETTER_TOPIC = "$deadletter"


class DeadLetterReason(StrEnum):
    """Why an envelope was dead-lettered."""

    NO_SUBSCRIBERS = "no_subscribers"
    HANDLER_FAILED = "handler_failed"
    REJECTED = "rejected"
    EXPIRED = "expired"
    DROPPED = "dropped"
    TIMEOUT = "timeout"
    #: Shed by a stage with admission control: it waited too long under overload.
    OVERLOAD = "overload"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One envelope that ended in the dead-letter queue.

    :ivar error: ``"ExceptionType: message"`` when an exception caused it, else ``None``.
    :ivar stage: name of the stage that dead-lettered it, ``None`` when it reached none.
    :ivar attempts: how many times a handler was tried.
    :ivar dead_at: epoch seconds when it died; it expires ``dead_letter_ttl`` later.
    :ivar traceback: for ``handler_failed``, the last three frames of the last
        attempt's traceback outside asyncbus, else ``None``.
    """

    envelope: Envelope
    reason: DeadLetterReason
    error: str | None
    stage: str | None
    attempts: int
    dead_at: float
    traceback: str | None = None


Resend = Callable[[DeadLetter], Awaitable[Receipt]]


class DeadLetterQueue:
    """Bounded, expiring store of :class:`DeadLetter` entries, oldest first.

    When full, the oldest entry is evicted (counted in :attr:`evicted`); entries
    expire ``ttl`` seconds after they died. One envelope id may have several
    entries (a fan-out that failed in two stages); id-based methods act on all of them.
    Its methods may be called from any thread (``replay`` on the bus's event loop).
    """

    def __init__(
        self,
        *,
        ttl: float,
        maxlen: int,
        resend: Resend,
        on_add: Callable[[DeadLetter], None] | None = None,
        on_remove: Callable[[builtins.list[str]], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl = ttl
        self.maxlen = maxlen
        #: Entries evicted because the queue was full.
        self.evicted = 0
        self._resend = resend
        self._on_add = on_add
        self._on_remove = on_remove
        self._clock = clock
        # The loop adds entries while any thread may read or purge them; even a read
        # expires entries. Every change of the indexes below happens under the lock,
        # and the callbacks (which publish or reach a broker) run after it is released.
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, DeadLetter] = OrderedDict()
        # When each entry died, on ``_clock`` (``dead_at`` is the wall clock's, for
        # people and other processes; the TTL is a duration, measured on the loop's).
        self._died: dict[int, float] = {}
        self._by_id: dict[str, list[int]] = {}
        # Keys of entries a replay is re-sending: a second replay of them finds none.
        self._replaying: set[int] = set()
        self._next_key = 0
        # Entries per (stage, reason), kept as they come and go, so metrics never scan.
        self._tally: Counter[tuple[str | None, DeadLetterReason]] = Counter()

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure the TTL on ``clock`` from now on (the bus's loop clock, at start)."""
        with self._lock:
            if clock is self._clock:
                return
            offset = clock() - self._clock()
            self._died = {key: died + offset for key, died in self._died.items()}
            self._clock = clock

    def add(self, dead_letter: DeadLetter) -> None:
        """Store ``dead_letter``, evicting the oldest entry when the queue is full."""
        with self._lock:
            self._expire()
            while len(self._entries) >= self.maxlen > 0:
                self._pop_key(next(iter(self._entries)))
                self.evicted += 1
            if self.maxlen > 0:
                self._store(dead_letter, self._clock())
            else:
                self.evicted += 1
        if self._on_add is not None:
            self._on_add(dead_letter)

    def restore(self, dead_letter: DeadLetter) -> None:
        """Store an entry loaded from a broker (no announcement, no eviction count)."""
        age = max(time.time() - dead_letter.dead_at, 0.0)
        if self.maxlen <= 0 or age >= self.ttl:
            return
        with self._lock:
            while len(self._entries) >= self.maxlen:
                self._pop_key(next(iter(self._entries)))
            self._store(dead_letter, self._clock() - age)

    def _store(self, dead_letter: DeadLetter, died: float) -> None:
        key = self._next_key
        self._next_key += 1
        self._entries[key] = dead_letter
        self._died[key] = died
        self._by_id.setdefault(dead_letter.envelope.id, []).append(key)
        self._tally[dead_letter.stage, dead_letter.reason] += 1

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._entries)

    def len(self) -> int:
        """Return how many entries are stored (same as ``len(queue)``)."""
        return self.__len__()

    def list(self, reason: str | None = None, topic: str | None = None) -> list[DeadLetter]:
        """Return the entries, oldest first, optionally only those of one reason or topic."""
        with self._lock:
            self._expire()
            entries = builtins.list(self._entries.values())
        return [
            entry
            for entry in entries
            if (reason is None or entry.reason == reason)
            and (topic is None or entry.envelope.topic == topic)
        ]

    def get(self, id: str) -> DeadLetter | None:
        """Return the oldest entry for envelope ``id``, or ``None``."""
        with self._lock:
            self._expire()
            keys = self._by_id.get(id) if isinstance(id, str) else None
            return self._entries[keys[0]] if keys else None

    async def replay(self, *ids: str | DeadLetter) -> builtins.list[Receipt]:
        """Re-send the envelopes ``ids`` to the stage that dead-lettered them.

        Each is re-sent with ``attempt`` 1, a fresh ``timestamp`` and the header
        ``asyncbus-replayed``, and its entry leaves the queue once it is on its way. An
        entry whose re-send fails (the bus stopped while it waited for room, say) stays.
        An id is an envelope's id (``entry.envelope.id``); an entry itself stands for
        its envelope's id.

        :raises KeyError: naming the ids that are not in the queue, or that another
            replay is re-sending right now; nothing is replayed then.
        """
        ids = _ids(ids, "replay")
        with self._lock:
            self._expire()
            missing = [id for id in ids if not self._free_keys(id)]
            if missing:
                raise KeyError(f"not in the dead-letter queue: {', '.join(missing)}")
            keys = builtins.list(dict.fromkeys(key for id in ids for key in self._free_keys(id)))
            # Claimed at once, before the first await: a concurrent replay of the same
            # ids gets KeyError instead of sending them a second time.
            self._replaying.update(keys)
        receipts: builtins.list[Receipt] = []
        try:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue  # purged or expired meanwhile
                # Re-send first: an entry leaves the queue only once it is on its way.
                receipts.append(await self._resend(entry))
                with self._lock:
                    self._replaying.discard(key)
                    if key in self._entries:
                        self._pop_key(key)
        finally:
            with self._lock:
                self._replaying.difference_update(keys)
        return receipts

    def _free_keys(self, id: str) -> builtins.list[int]:
        return [key for key in self._by_id.get(id, ()) if key not in self._replaying]

    def purge(self, *ids: str | DeadLetter) -> int:
        """Remove the entries of ``ids`` (all entries when none given); return how many.

        Like :meth:`replay`, an entry itself stands for its envelope's id.
        """
        ids = _ids(ids, "purge")
        with self._lock:
            if not ids:
                removed = len(self._entries)
                gone = builtins.list(self._by_id)
                self._entries.clear()
                self._died.clear()
                self._by_id.clear()
                self._tally.clear()
            else:
                removed = 0
                gone = []
                for id in ids:
                    keys = self._by_id.get(id, [])[:]
                    for key in keys:
                        self._pop_key(key)
                        removed += 1
                    if keys:
                        gone.append(id)
        if gone and self._on_remove is not None:
            self._on_remove(gone)
        return removed

    def _counts(self) -> dict[tuple[str | None, DeadLetterReason], int]:
        """Entries stored now per (stage, reason), without scanning the queue (metrics)."""
        with self._lock:
            self._expire()
            return {key: count for key, count in self._tally.items() if count}

    # (The helpers below are called with the lock held.)

    def _pop_key(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._tally[entry.stage, entry.reason] -= 1
        del self._died[key]
        keys = self._by_id[entry.envelope.id]
        keys.remove(key)
        if not keys:
            del self._by_id[entry.envelope.id]

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl
        died = self._died
        while died:
            key = next(iter(died))
            if died[key] > deadline:
                break
            self._pop_key(key)


def _ids(given: tuple[str | DeadLetter, ...], method: str) -> tuple[str, ...]:
    """Envelope ids from ids and entries; a :class:`TypeError` naming anything else."""
    ids: builtins.list[str] = []
    for item in given:
        if isinstance(item, DeadLetter):
            ids.append(item.envelope.id)
        elif isinstance(item, str):
            ids.append(item)
        else:
            raise TypeError(
                f"{method}() takes envelope ids (dead.envelope.id) or DeadLetter entries, "
                f"got {item!r}"
            )
    return tuple(ids)
