"""The bus's life as the layers below it read it: one small object the bus keeps up to
date, handed to them instead of the bus itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from anyio.abc import TaskGroup
    from anyio.from_thread import BlockingPortal

__all__ = ["Life", "State"]

#: Where a bus is in its life.
State = Literal["new", "starting", "running", "closing", "closed"]


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
