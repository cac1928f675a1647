"""The bus's life as the layers below it read it: one small object the bus keeps up to
date, handed to them instead of the bus itself."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

from ._exceptions import BusClosedError, not_started

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from anyio.from_thread import BlockingPortal

__all__ = ["Life", "State"]

#: Where a bus is in its life.
State = Literal["new", "starting", "running", "closing", "closed"]

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Life:
    """Where the bus is in its life, and what it runs on while it runs.

    :ivar state: ``"new"``, ``"starting"``, ``"running"``, ``"closing"`` or ``"closed"``.
    :ivar loop_thread: the thread of the event loop the bus runs (or last ran) on.
    :ivar task_group: the bus's task group while it runs.
    :ivar portal: the portal other threads reach the loop through while it runs.
    """

    state: State = "new"
    loop_thread: int | None = None
    task_group: TaskGroup | None = None
    portal: BlockingPortal | None = None

    def is_running(self) -> bool:
        """Whether the bus runs (started, no stop asked for)."""
        return self.state == "running"

    def tasks(self) -> TaskGroup:
        """The one task group that owns every task of the running bus.

        :raises BusClosedError: when the bus is not running.
        """
        if self.task_group is None:
            if self.state == "new":
                raise not_started("start tasks")
            raise BusClosedError("the bus is not running: use `async with bus:`")
        return self.task_group

    def on_loop(self, read: Callable[[], T]) -> T:
        """``read()`` on the thread that runs the bus (where its state lives), from any thread.

        From another thread it waits for the loop to run it; on the loop's thread, or
        when the bus is not running, it runs here.
        """
        portal = self.portal
        if portal is None or threading.get_ident() == self.loop_thread:
            return read()
        try:
            return portal.call(read)
        except (RuntimeError, concurrent.futures.CancelledError):
            return read()  # the portal stopped meanwhile: the bus is closing, nothing moves
