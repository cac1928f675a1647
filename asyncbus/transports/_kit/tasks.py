"""The one task group a transport owns: its background tasks, from connect to close."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import AsyncExitStack
from typing import Any

import anyio
from anyio.abc import TaskGroup

from ..._exceptions import TransportError

__all__ = ["TaskOwner"]


class TaskOwner:
    """Runs a transport's background tasks (writers, pollers, keep-alives, lingering
    clean-ups) in one task group, opened by :meth:`open` (in ``connect``) and closed
    by :meth:`aclose` (in ``aclose``, in the same task, as ``async with`` does).

    Nothing a transport starts is fire-and-forget: every task is a child of this
    group, cancelled and awaited when the transport closes.

    The group's cancel scope is entered by :meth:`open`, so :meth:`aclose` must run
    where a ``with`` block around the group would end: in the task that opened it,
    never inside a cancel scope entered after :meth:`open` (a shielded clean-up scope
    included; anyio refuses with ``RuntimeError``). A ``connect`` that fails after
    opening it closes it first, then closes its connection shielded.

    :param owner: the transport's name, for errors.
    """

    __slots__ = ("_group", "_owner", "_stack")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._stack: AsyncExitStack | None = None
        self._group: TaskGroup | None = None

    @property
    def running(self) -> bool:
        """Whether the group is open (between :meth:`open` and :meth:`aclose`)."""
        return self._group is not None

    async def open(self) -> None:
        """Open the task group (nothing happens if it is open already)."""
        if self._group is not None:
            return
        stack = AsyncExitStack()
        self._group = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack

    def start_soon(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``function(*args)`` in the group until it returns or the group closes.

        :raises TransportError: when the group is not open (the transport is not
            connected, or closed).
        """
        if self._group is None:
            raise TransportError(f"{self._owner} is not connected: use `async with transport:`")
        self._group.start_soon(function, *args, name=name)

    async def aclose(self) -> None:
        """Cancel every task and wait for them (their clean-up runs shielded)."""
        stack, group = self._stack, self._group
        self._stack = self._group = None
        if stack is None or group is None:
            return
        group.cancel_scope.cancel()
        await stack.aclose()
