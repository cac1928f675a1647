"""The queue of a controlled stage: one lane per priority class, either end servable."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._admission import Priority
from ._envelope import HEADER_PRIORITY

if TYPE_CHECKING:
    from ._envelope import Envelope

__all__ = ["Lanes", "priority_of"]

_NORMAL = int(Priority.NORMAL)
_CLASSES = len(Priority)
_BY_TEXT = {str(int(level)): int(level) for level in Priority}

Item = tuple[float, "Envelope"]


def priority_of(envelope: Envelope) -> int:
    """The envelope's priority class; ``NORMAL`` when its header is absent or unknown."""
    text = envelope.headers.get(HEADER_PRIORITY)
    return _NORMAL if text is None else _BY_TEXT.get(text, _NORMAL)


class Lanes:
    """Items ``(admitted_at, envelope)`` in one FIFO deque per priority class.

    Higher classes are served first; within a class the oldest (``take``) or the
    newest (``take(newest_first=True)``). Every item is stamped on entry with the
    clock the stage's controllers read, whatever stamp it came with.
    """

    __slots__ = ("_clock", "_lanes", "_size")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lanes: tuple[deque[Item], ...] = tuple(deque() for _ in range(_CLASSES))
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, item: Item) -> None:
        """Enqueue ``item``'s envelope, stamped now."""
        envelope = item[1]
        self._lanes[priority_of(envelope)].append((self._clock(), envelope))
        self._size += 1

    def push_waited(self, envelope: Envelope, waited: float) -> None:
        """Enqueue ``envelope`` as if admitted ``waited`` seconds ago (it waited that long
        in a broker), but never before the newest of its lane: each lane stays oldest
        first."""
        lane = self._lanes[priority_of(envelope)]
        stamp = self._clock() - waited
        if lane and lane[-1][0] > stamp:
            stamp = lane[-1][0]
        lane.append((stamp, envelope))
        self._size += 1

    def take(self, newest_first: bool = False) -> Item:
        """Remove and return the item to serve next (``IndexError`` when empty)."""
        for lane in reversed(self._lanes):
            if lane:
                self._size -= 1
                return lane.pop() if newest_first else lane.popleft()
        raise IndexError("take from empty lanes")

    def pop_oldest(self) -> Item:
        """Remove and return the oldest item of the lowest class (what eviction sheds)."""
        for lane in self._lanes:
            if lane:
                self._size -= 1
                return lane.popleft()
        raise IndexError("pop from empty lanes")

    def oldest_admitted(self) -> float:
        """When the longest-waiting item was admitted (``inf`` when empty)."""
        return min((lane[0][0] for lane in self._lanes if lane), default=float("inf"))

    def take_stale(self, before: float) -> list[Envelope]:
        """Remove and return every envelope admitted before ``before``, lowest class first."""
        stale: list[Envelope] = []
        for lane in self._lanes:
            while lane and lane[0][0] < before:
                stale.append(lane.popleft()[1])
        self._size -= len(stale)
        return stale
