"""Running a sync handler on the bus's worker pool, holding its slot until it returns."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread

if TYPE_CHECKING:
    from ._envelope import Envelope

__all__ = [
    "hold_switch_interval",
    "offloaded_envelope",
    "release_switch_interval",
    "run_in_worker",
    "run_niced",
]

# Set in a worker thread's own context (a copy of the consumer's) to the envelope its
# handler was given: a publish from that thread is caused by it, even after a timeout
# abandoned the attempt and the consumer went on to another envelope.
_offloaded: ContextVar[Envelope | None] = ContextVar("asyncbus_offloaded", default=None)


def offloaded_envelope() -> Envelope | None:
    """The envelope the offloaded handler running in this thread handles, else ``None``."""
    return _offloaded.get()

#: How much lower than the event loop's process a CPU-bound worker process runs.
WORKER_NICENESS = 5
_niced = False


def run_niced(function: Callable[[Any], Any], argument: Any) -> Any:
    """Call ``function(argument)`` in a worker process that yields the CPU to the loop.

    The first call in each worker process lowers its priority by
    :data:`WORKER_NICENESS`: with as many busy workers as cores, the process running
    the event loop is then scheduled first and its lag stays low.
    """
    global _niced
    if not _niced:
        _niced = True
        with contextlib.suppress(OSError, AttributeError):  # not on every platform
            os.nice(WORKER_NICENESS)
    return function(argument)


class _Slot:
    """One borrowed pool slot, released by whichever side sees the thread finish last."""

    __slots__ = ("abandoned", "finished", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.finished = False
        self.abandoned = False


async def run_in_worker(
    function: Callable[[Any], Any],
    argument: Any,
    limiter: anyio.CapacityLimiter,
    envelope: Envelope | None = None,
) -> Any:
    """Run ``function(argument)`` in a worker thread under the bus-wide ``limiter``.

    If the caller is cancelled (a stage timeout, shutdown) the attempt is abandoned at
    once, but the thread runs to its end *holding its slot*: the pool never runs more
    than ``workers`` handlers, even abandoned ones. (anyio's own ``limiter=`` would
    free the slot when the caller gives up.)

    :param envelope: the envelope being handled, for :func:`offloaded_envelope`.
    """
    slot = _Slot()
    await limiter.acquire_on_behalf_of(slot)

    def run() -> Any:
        # (The worker runs this in a copy of the caller's context: setting it is local.)
        _offloaded.set(envelope)
        try:
            return function(argument)
        finally:
            with slot.lock:
                slot.finished = True
                abandoned = slot.abandoned
            if abandoned:
                # (When the event loop is gone there is nothing left to free.)
                with contextlib.suppress(RuntimeError):
                    anyio.from_thread.run_sync(limiter.release_on_behalf_of, slot)

    try:
        result = await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
    except BaseException:
        with slot.lock:
            slot.abandoned = not slot.finished
            release_now = slot.finished
        if release_now:
            limiter.release_on_behalf_of(slot)
        raise
    limiter.release_on_behalf_of(slot)
    return result


#: The GIL hand-over interval while a bus runs sync handlers in threads (GIL builds).
SWITCH_INTERVAL = 0.0005
_switch_holders = 0
_switch_saved: float | None = None


def hold_switch_interval() -> None:
    """Shorten the interpreter's GIL switch interval while worker threads may be busy.

    On a GIL build a busy worker thread keeps the GIL until the event loop's thread
    has waited ``sys.getswitchinterval()`` (5 ms by default), which is then the loop's
    lag on every wake-up. Each running bus with thread-offloaded stages holds the
    shorter interval; the interpreter's own value comes back when the last one stops.
    Free-threaded builds have no GIL to hand over and are left alone.
    """
    global _switch_holders, _switch_saved
    if _free_threaded():
        return
    if _switch_holders == 0:
        _switch_saved = sys.getswitchinterval()
        if _switch_saved > SWITCH_INTERVAL:
            sys.setswitchinterval(SWITCH_INTERVAL)
    _switch_holders += 1


def release_switch_interval() -> None:
    """Undo one :func:`hold_switch_interval`."""
    global _switch_holders, _switch_saved
    if _free_threaded() or _switch_holders == 0:
        return
    _switch_holders -= 1
    if _switch_holders == 0 and _switch_saved is not None:
        sys.setswitchinterval(_switch_saved)
        _switch_saved = None


def _free_threaded() -> bool:
    from ._runtime import FREE_THREADED

    return FREE_THREADED
