"""A stage's door, in words: what happened there, and a place in its line for room."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import anyio

__all__ = ["DoorOutcome", "RoomWaiter"]


class DoorOutcome(Enum):
    """What happened at a stage's door."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"
    DROPPED = "dropped"
    BLOCKED = "blocked"


class RoomWaiter:
    """One place in a stage's line for room: a publish, a retry, a batch or the pump.

    The line is first come, first served: room that appears is handed to the first
    in line, and nobody behind it (nor a new publish) may take it. A waiter with
    ``enter`` is admitted by the hand-over itself, in its turn, before its task runs
    again, so publishes keep their order in the queue; one without ``enter`` holds
    the room (``need`` places) until it takes it (:meth:`Stage.take_room`).

    :ivar need: places it waits for (several for a batch).
    :ivar bound: the most the queue may hold for it, ``None`` for the capacity.
    :ivar handed: whether it was handed its room (and, with ``enter``, admitted).
    """

    __slots__ = ("bound", "enter", "event", "handed", "need")

    def __init__(
        self,
        need: int = 1,
        enter: Callable[[], None] | None = None,
        bound: Callable[[], int] | None = None,
    ) -> None:
        self.need = need
        self.enter = enter
        self.bound = bound
        self.handed = False
        self.event = anyio.Event()
