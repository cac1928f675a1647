"""Order per key: a stage that hands out one envelope of each publish ``key`` at a time.

A stage subscribed with ``ordering="key"`` keeps a :class:`KeyGate` in front of its
queue. An envelope whose key no other envelope of the stage holds *claims* the key and
goes to the queue the consumers take from; one whose key is claimed waits in that key's
line, in the order it was admitted. The claim lasts until its envelope is settled for
good (acked, skipped, dead-lettered, shed, abandoned): a retry or a :class:`Defer`
keeps it, so nothing of that key overtakes it. Settling hands the claim to the first
of the line, which joins the queue. Envelopes without a key pass straight through.

Everything waiting in a line still counts as queued (the stage's depth and its room),
so a hot key fills the stage and meets its back-pressure like any other work; only
the holder of a key coming back from a retry re-enters without waiting for room (its
own followers may be what fills the stage).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Literal

from ._envelope import HEADER_KEY, Envelope

__all__ = ["KEY_FAILURES", "ORDERINGS", "KeyFailure", "KeyGate", "Ordering"]

Item = tuple[float, Envelope]
#: What ``subscribe(ordering=...)`` accepts besides ``None``.
Ordering = Literal["key"]
ORDERINGS = ("key",)
#: What becomes of a key's waiting envelopes when one of it is dead-lettered.
KeyFailure = Literal["continue", "stop"]
KEY_FAILURES = ("continue", "stop")


class KeyGate:
    """The per-key lines of one ordered stage (see the module's docstring).

    :param enqueue: puts an item in the queue the consumers take from.
    :param stop: dead-letter a key's waiting envelopes when one of it is dead-lettered
        (``key_failure="stop"``) instead of letting the next one go on.
    """

    __slots__ = ("_enqueue", "_lines", "stop", "waiting")

    def __init__(self, enqueue: Callable[[Item], None], *, stop: bool = False) -> None:
        self._enqueue = enqueue
        #: key -> its waiting items, first first; a key is here while it is claimed.
        self._lines: dict[str, deque[Item]] = {}
        self.stop = stop
        #: Items waiting in a line (a part of the stage's ``queued``).
        self.waiting = 0

    def enters(self, item: Item) -> bool:
        """Whether ``item`` may join the queue now (it claims its key, or has none);
        otherwise it was put in its key's line."""
        key = item[1].headers.get(HEADER_KEY)
        if key is None:
            return True
        line = self._lines.get(key)
        if line is None:
            self._lines[key] = deque()
            return True
        line.append(item)
        self.waiting += 1
        return False

    def push(self, item: Item) -> None:
        """Admit ``item``: into the queue if it claims its key, else into its line."""
        if self.enters(item):
            self._enqueue(item)

    def holds(self, envelope: Envelope) -> bool:
        """Whether ``envelope``'s key is claimed (by it, when it is being settled)."""
        key = envelope.headers.get(HEADER_KEY)
        return key is not None and key in self._lines

    def release(self, envelope: Envelope) -> bool:
        """``envelope``, which held its key, is settled: the key's next item joins the queue.

        :return: whether an item joined the queue (a consumer should be woken).
        """
        key = envelope.headers.get(HEADER_KEY)
        if key is None:
            return False
        line = self._lines.get(key)
        if line is None:
            return False
        if not line:
            del self._lines[key]
            return False
        self.waiting -= 1
        self._enqueue(line.popleft())
        return True

    def give_up(self, envelope: Envelope) -> list[Envelope]:
        """``envelope``, which held its key, was dead-lettered under ``stop``: the key's
        waiting envelopes leave with it (the caller dead-letters them) and the key is
        free for what comes next.
        """
        key = envelope.headers.get(HEADER_KEY)
        line = self._lines.pop(key, None) if key is not None else None
        if not line:
            return []
        self.waiting -= len(line)
        return [waiting for _, waiting in line]

    def evict(self) -> Item | None:
        """Take the oldest waiting item of the line that was claimed first (a full
        ``DROP_OLDEST`` stage whose queue holds nothing else); ``None`` when none waits."""
        for line in self._lines.values():
            if line:
                self.waiting -= 1
                return line.popleft()
        return None

    @property
    def keys_waiting(self) -> int:
        """Keys that have envelopes waiting for their turn."""
        return sum(1 for line in self._lines.values() if line)

    @property
    def keys_held(self) -> int:
        """Keys claimed now (an envelope of each is queued, in flight or retrying)."""
        return len(self._lines)

    def clear(self) -> list[str]:
        """The stage stopped: forget every claim; return the waiting envelopes' ids."""
        left = [item[1].id for line in self._lines.values() for item in line]
        self._lines.clear()
        self.waiting = 0
        return left
