"""A middleware that cancels an offloaded handler between taking its slot and its thread."""

from __future__ import annotations

from typing import Any

import anyio

from asyncbus import Envelope, Handler, middleware


@middleware
async def cancel_once_the_slot_is_taken(env: Envelope, call_next: Handler) -> Any:
    """Cancel the handler at its first yield: just after it took a worker slot.

    The pool takes the slot, then yields once before it hands the call to a thread;
    a helper task started here runs at that yield and cancels, so the cancellation
    lands after the slot is taken and before any thread started.
    """

    async def cancel(scope: anyio.CancelScope) -> None:
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel, tg.cancel_scope)
        return await call_next(env)
