"""The dead-letter queue: where envelopes that could not be handled wait for a person."""

from __future__ import annotations

import builtins
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import anyio

from ._envelope import Envelope, Receipt

__all__ = [
    "DEADLETTER_TOPIC",
    "DeadLetter",
    "DeadLetterKey",
    "DeadLetterQueue",
    "DeadLetterReason",
    "SharedStore",
    "dead_letter_key",
]

#: Topic on which every new dead letter is published, as a :class:`DeadLetter` payload.
DEADLETTER_TOPIC = "$deadletter"

#: Seconds a replay waits for an entry this process dead-lettered just now to reach the
#: broker's store (its delivery's reject, which stores it, may still be on its way).
_ARRIVING = 2.0


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
    #: Waiting for its key on an ordered stage (``key_failure="stop"``) when an earlier
    #: envelope of that key was dead-lettered.
    KEY_STOPPED = "key_stopped"


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One envelope that ended in the dead-letter queue.

    :ivar error: ``"ExceptionType: message"`` when an exception caused it, else ``None``.
    :ivar stage: name of the stage that dead-lettered it, ``None`` when it reached none.
    :ivar attempts: how many times a handler was tried: for an envelope dropped or
        shed from the queue, the attempts it had before (0 unless it was waiting to be
        retried).
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

#: What tells two dead letters apart wherever they are kept: the envelope's id and
#: timestamp, the stage and the reason (``dead_at`` is not in it: a broker's copy of an
#: entry is stamped when the broker takes it).
DeadLetterKey = tuple[str, float, str | None, str]


def dead_letter_key(entry: DeadLetter) -> DeadLetterKey:
    """The :data:`DeadLetterKey` of ``entry``."""
    envelope = entry.envelope
    return (envelope.id, envelope.timestamp, entry.stage, entry.reason.value)


class SharedStore(Protocol):
    """Where dead letters are kept for every process (a broker), as the queue uses it.

    Its removal is the claim: of two calls of :meth:`take` that would remove one entry,
    exactly one gets it.
    """

    async def load(self) -> builtins.list[DeadLetter]:
        """Every entry kept now, oldest first."""

    async def take(self, ids: Sequence[str]) -> builtins.list[DeadLetter]:
        """Remove the entries of ``ids``; return those this call removed."""

    async def put_back(self, entries: Sequence[DeadLetter]) -> None:
        """Keep ``entries`` again (taken, then not re-sent)."""


class _NotQueued(KeyError):
    """A replay of ids the queue does not hold (``ids``): nothing was replayed."""

    def __init__(self, ids: Sequence[str]) -> None:
        super().__init__(f"not in the dead-letter queue: {', '.join(ids)}")
        self.ids = builtins.list(ids)


# A change of the queue, as a refresh replays it onto what it read (see ``refresh``).
_Change = tuple[str, Any]


class DeadLetterQueue:
    """Bounded, expiring store of :class:`DeadLetter` entries, oldest first.

    When full, the oldest entry is evicted (counted in :attr:`evicted`); entries
    expire ``ttl`` seconds after they died. One envelope id may have several
    entries (a fan-out that failed in two stages); id-based methods act on all of them.

    Over a broker that keeps dead letters for every process, this is that store's view
    in this process: the bus keeps it up to date as the broker tells of entries added
    or removed by any process, :meth:`refresh` reads the broker again, and
    :meth:`replay` and :meth:`purge` act on the broker's entries, whichever process
    stored them (a replay claims them there first, so it happens once).

    Its methods may be called from any thread (``replay`` on the bus's event loop).
    """

    def __init__(
        self,
        *,
        ttl: float,
        maxlen: int,
        resend: Resend,
        on_add: Callable[[DeadLetter], None] | None = None,
        on_remove: Callable[[builtins.list[str], bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        before_replay: Callable[[], None] | None = None,
    ) -> None:
        self.ttl = ttl
        self.maxlen = maxlen
        #: Entries evicted because the queue was full.
        self.evicted = 0
        self._resend = resend
        self._on_add = on_add
        self._on_remove = on_remove
        self._before_replay = before_replay
        self._clock = clock
        # The loop adds entries while any thread may read or purge them; even a read
        # expires entries. Every change of the indexes below happens under the lock
        # (re-entrant: a change the broker told of merges entry by entry), and the
        # callbacks (which publish or reach a broker) run after it is released.
        self._lock = threading.RLock()
        self._entries: OrderedDict[int, DeadLetter] = OrderedDict()
        # When each entry died, on ``_clock`` (``dead_at`` is the wall clock's, for
        # people and other processes; the TTL is a duration, measured on the loop's).
        self._died: dict[int, float] = {}
        self._by_id: dict[str, list[int]] = {}
        self._by_key: dict[DeadLetterKey, int] = {}
        # Over a broker: ids this process dead-lettered, and when (the loop's clock), for
        # a replay that comes before the broker has stored them (``_take_arriving``).
        self._arriving: dict[str, float] = {}
        # Keys of entries a replay is re-sending: a second replay of them finds none.
        self._replaying: set[int] = set()
        self._next_key = 0
        # Entries per (stage, reason), kept as they come and go, so metrics never scan.
        self._tally: Counter[tuple[str | None, DeadLetterReason]] = Counter()
        # The broker's store, when it keeps dead letters for every process (see ``share``).
        self._shared: SharedStore | None = None
        self._load: Callable[[], Awaitable[builtins.list[DeadLetter]]] | None = None
        # The changes made while a refresh waits for the broker, one list per refresh.
        self._journals: builtins.list[builtins.list[_Change]] = []

    def share(
        self,
        load: Callable[[], Awaitable[builtins.list[DeadLetter]]] | None,
        shared: SharedStore | None,
    ) -> None:
        """Be the view of a broker's store: ``load`` reads it (for :meth:`refresh`), and
        ``shared``, when the broker's removal is a claim, takes replays and purges.
        ``None`` for both: this process's entries alone (in memory)."""
        self._load = load
        self._shared = shared

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
            if self._shared is not None:  # (its store in the broker may lag a moment)
                self._note_arriving(dead_letter.envelope.id)
            self._journal("merge", [dead_letter])
            # Over a broker, the broker may have told of it first (its copy): this one,
            # which may know more, takes its place. (In memory, every entry is one.)
            known = self._by_key.get(dead_letter_key(dead_letter)) if self._load else None
            if known is not None:
                self._entries[known] = dead_letter
            elif self.maxlen > 0:
                while len(self._entries) >= self.maxlen:
                    self._pop_key(next(iter(self._entries)))
                    self.evicted += 1
                self._store(dead_letter, self._clock())
            else:
                self.evicted += 1
        if self._on_add is not None:
            self._on_add(dead_letter)

    def restore(self, dead_letter: DeadLetter) -> None:
        """Store an entry the broker keeps (no announcement, no eviction count); one
        the queue holds already (the same :func:`dead_letter_key`) is kept as it is."""
        self._merge(dead_letter)

    def _merge(self, dead_letter: DeadLetter) -> None:
        age = max(time.time() - dead_letter.dead_at, 0.0)
        if self.maxlen <= 0 or age >= self.ttl:
            return
        with self._lock:
            if dead_letter_key(dead_letter) in self._by_key:
                return
            while len(self._entries) >= self.maxlen:
                self._pop_key(next(iter(self._entries)))
            self._store(dead_letter, self._clock() - age)

    def changed(
        self, added: Sequence[DeadLetter] = (), removed: Sequence[DeadLetterKey] = ()
    ) -> None:
        """The broker told of entries ``added`` and removed (their keys) by any process."""
        with self._lock:
            self._expire()
            if added:
                self._journal("merge", added)
                for entry in added:
                    self._merge(entry)
            if removed:
                self._journal("drop", removed)
                self._drop_keys(removed)

    async def refresh(self) -> None:
        """Read the broker's dead letters again, so the queue lists exactly what every
        process stored (what the broker held when it answered, and what changed since).

        Over a broker the queue is kept up to date as the broker tells of changes, which
        reach it within a moment; this is for when that moment matters (a script about
        to act on the list). In memory it does nothing.

        :raises TransportError: when the broker cannot be read (the list stays as it was).
        """
        if self._load is None:
            with self._lock:
                self._expire()
            return
        journal: builtins.list[_Change] = []
        with self._lock:
            self._journals.append(journal)
        try:
            entries = await self._load()
        finally:
            with self._lock:
                self._journals.remove(journal)
        with self._lock:
            self._reset(entries)
            for change in journal:
                self._replay_change(change)

    def _reset(self, entries: Sequence[DeadLetter]) -> None:
        """Hold ``entries`` (the broker's listing) and nothing else."""
        self._clear()
        for entry in sorted(entries, key=lambda entry: entry.dead_at):
            self._merge(entry)

    def _journal(self, kind: str, what: Any) -> None:
        for journal in self._journals:
            journal.append((kind, what))

    def _replay_change(self, change: _Change) -> None:
        kind, what = change
        if kind == "merge":
            for entry in what:
                self._merge(entry)
        elif kind == "drop":
            self._drop_keys(what)
        elif kind == "drop_ids":
            for id in what:
                for key in self._by_id.get(id, [])[:]:
                    self._pop_key(key)
        else:  # "clear"
            self._clear()

    def _drop_keys(self, keys: Sequence[DeadLetterKey]) -> None:
        for found in keys:
            key = self._by_key.get(found)
            if key is not None:
                self._pop_key(key)

    def _store(self, dead_letter: DeadLetter, died: float) -> None:
        key = self._next_key
        self._next_key += 1
        self._entries[key] = dead_letter
        self._died[key] = died
        self._by_id.setdefault(dead_letter.envelope.id, []).append(key)
        self._by_key[dead_letter_key(dead_letter)] = key
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

        Over a broker the entries are the broker's, whichever process stored them: each
        is taken out of the broker's store before it is re-sent, and of processes (or
        tasks) replaying one id at once exactly one does.

        :raises KeyError: naming the ids that are not in the queue, or that another
            replay is re-sending right now; nothing is replayed then.
        """
        ids = _ids(ids, "replay")
        if self._shared is not None:
            return await self._replay_shared(self._shared, tuple(dict.fromkeys(ids)))
        with self._lock:
            self._expire()
            missing = [id for id in ids if not self._free_keys(id)]
            if missing:
                raise _NotQueued(missing)
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

    async def _replay_shared(
        self, shared: SharedStore, ids: tuple[str, ...]
    ) -> builtins.list[Receipt]:
        """:meth:`replay` over a broker's store: take (the claim), then re-send."""
        if self._before_replay is not None:
            self._before_replay()  # refused before anything is taken
        # Shielded: an entry taken out of the broker is re-sent or put back, whatever
        # happens to the caller meanwhile (each step is bounded by the transport).
        with anyio.CancelScope(shield=True):
            taken = await shared.take(ids)
            found = {entry.envelope.id for entry in taken}
            missing = [id for id in ids if id not in found]
            if missing:
                # Listed here a moment before the broker has it (its delivery's reject,
                # which stores it, is on its way): wait for that store, within a bound.
                taken += await self._take_arriving(shared, missing)
                found = {entry.envelope.id for entry in taken}
                missing = [id for id in ids if id not in found]
            if missing:
                if taken:
                    await shared.put_back(taken)
                raise _NotQueued(missing)
            # In the order asked for (as in memory); this process's own entry where it
            # has one: it may know more (a traceback, the payload as it was).
            order = {id: position for position, id in enumerate(ids)}
            taken.sort(key=lambda entry: order[entry.envelope.id])
            with self._lock:
                self._expire()
                entries = [self._own(entry) for entry in taken]
                keys = [dead_letter_key(entry) for entry in entries]
                self._journal("drop", keys)
                self._drop_keys(keys)
            receipts: builtins.list[Receipt] = []
            for position, entry in enumerate(entries):
                try:
                    receipts.append(await self._resend(entry))
                except BaseException:  # deliberate: what was not re-sent is kept; re-raise
                    await shared.put_back(entries[position:])
                    self.changed(added=entries[position:])
                    raise
        return receipts

    def _note_arriving(self, id: str) -> None:
        """Remember that this process dead-lettered ``id`` now; forget those noted
        :data:`_ARRIVING` seconds ago or more (the oldest first: notes are in time order)."""
        arriving, now = self._arriving, self._clock()
        arriving.pop(id, None)
        arriving[id] = now
        while now - arriving[first := next(iter(arriving))] >= _ARRIVING:
            del arriving[first]

    async def _take_arriving(
        self, shared: SharedStore, ids: builtins.list[str]
    ) -> builtins.list[DeadLetter]:
        """Take those of ``ids`` that this process dead-lettered less than
        :data:`_ARRIVING` seconds ago as they reach the broker's store (looked for every
        20 ms until then); the others (another process's, or older) are not waited for."""
        with self._lock:
            now = self._clock()
            arriving = self._arriving
            recent = [id for id in ids if now - arriving.get(id, -math.inf) < _ARRIVING]

        taken: builtins.list[DeadLetter] = []
        with anyio.move_on_after(_ARRIVING):
            while recent:
                await anyio.sleep(0.02)
                more = await shared.take(recent)
                taken += more
                arrived = {entry.envelope.id for entry in more}
                recent = [id for id in recent if id not in arrived]
        return taken

    def _own(self, entry: DeadLetter) -> DeadLetter:
        key = self._by_key.get(dead_letter_key(entry))
        return entry if key is None else self._entries[key]

    def _free_keys(self, id: str) -> builtins.list[int]:
        return [key for key in self._by_id.get(id, ()) if key not in self._replaying]

    def purge(self, *ids: str | DeadLetter) -> int:
        """Remove the entries of ``ids`` (all entries when none given); return how many.

        Like :meth:`replay`, an entry itself stands for its envelope's id. Over a broker
        the broker's entries of those ids (every process's; all of them when no id is
        given) are removed too, in the background (``drain()`` waits for it); the count
        is of the entries this queue listed.
        """
        ids = _ids(ids, "purge")
        with self._lock:
            if not ids:
                removed = len(self._entries)
                gone = builtins.list(self._by_id)
                self._journal("clear", None)
                self._clear()
                everything = True
            else:
                removed = 0
                gone = builtins.list(dict.fromkeys(ids))
                self._journal("drop_ids", gone)
                for id in gone:
                    for key in self._by_id.get(id, [])[:]:
                        self._pop_key(key)
                        removed += 1
                everything = False
        if (gone or everything) and self._on_remove is not None:
            self._on_remove(gone, everything)
        return removed

    def _clear(self) -> None:
        self._entries.clear()
        self._died.clear()
        self._by_id.clear()
        self._by_key.clear()
        self._tally.clear()

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
        found = dead_letter_key(entry)
        if self._by_key.get(found) == key:
            del self._by_key[found]
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
