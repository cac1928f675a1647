"""Running a sync handler on the bus's worker pool, holding its slot until it returns."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import sysconfig
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from . import _runtime
from ._failures import HandlerExited
from ._runtime import current_backend

if TYPE_CHECKING:
    from ._envelope import Envelope

__all__ = [
    "WorkerPool",
    "hold_switch_interval",
    "offloaded_envelope",
    "release_switch_interval",
    "run_niced",
    "thread_pool_reason",
]

# Set in a worker thread's own context (a copy of the consumer's) to the envelope its
# handler was given: a publish from that thread is caused by it, even after a timeout
# abandoned the attempt and the consumer went on to another envelope.
_offloaded: ContextVar[Envelope | None] = ContextVar("asyncbus_offloaded", default=None)


def offloaded_envelope() -> Envelope | None:
    """The envelope the offloaded handler running in this thread handles, else ``None``."""
    return _offloaded.get()


#: A niceness for worker processes that keeps the loop's process first in line.
WORKER_NICENESS = 5
_niced = False


def run_niced(function: Callable[[Any], Any], argument: Any, niceness: int) -> Any:
    """Call ``function(argument)`` in a worker process that yields the CPU to the loop.

    The first call in each worker process lowers its priority by ``niceness``
    (``Bus(worker_niceness=)``): with as many busy workers as cores, the process
    running the event loop is then scheduled first and its lag stays low. The worker
    processes are anyio's, shared by the whole program, so this is asked for.
    """
    global _niced
    if not _niced:
        _niced = True
        with contextlib.suppress(OSError, AttributeError):  # not on every platform
            os.nice(niceness)
    return function(argument)


class _Slot:
    """One borrowed pool slot, handed back by whichever side sees the thread end last.

    ``started`` and ``finished`` are set by the worker thread, ``abandoned`` by the
    caller when it gives up (cancelled); all under ``lock``.
    """

    __slots__ = ("abandoned", "finished", "lock", "started")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.finished = False
        self.abandoned = False


class WorkerPool:
    """The bus-wide pool of ``workers`` slots shared by thread and process offload.

    Made on the event loop when the bus starts. A thread holds its slot until it
    returns, even after its caller gave up (a stage timeout, shutdown), so the pool
    never runs more than ``workers`` handlers, abandoned ones included.

    :ivar limiter: the ``workers`` slots (also the process pool's limiter).
    """

    def __init__(self, workers: int) -> None:
        self.limiter = anyio.CapacityLimiter(workers)
        # The slots are the bus's own, held past a cancellation; anyio's thread call is
        # given a limiter that never binds, so its process-wide default (40 threads)
        # does not cap a pool larger than that.
        self._threads = anyio.CapacityLimiter(math.inf)
        self._call_soon = _loop_call_soon()

    async def run(
        self, function: Callable[[Any], Any], argument: Any, envelope: Envelope | None = None
    ) -> Any:
        """Run ``function(argument)`` in a worker thread, in one of the pool's slots.

        :param envelope: the envelope being handled, for :func:`offloaded_envelope`.
        """
        slot = _Slot()
        limiter = self.limiter
        await limiter.acquire_on_behalf_of(slot)
        call_soon = self._call_soon

        def run() -> tuple[Any]:
            with slot.lock:
                if slot.abandoned:
                    return (None,)  # given up before it started: the caller freed the slot
                slot.started = True
            # (The worker runs this in a copy of the caller's context: setting it is local.)
            _offloaded.set(envelope)
            try:
                # Boxed: trio refuses a thread function that returns a coroutine, and a
                # sync wrapper of an async handler returns one (awaited on the loop).
                return (function(argument),)
            except GeneratorExit as error:
                # A failure like any exception (see handler_failure), turned into one
                # here: a GeneratorExit must not cross the thread hand-over (on asyncio
                # it breaks the next coroutine that awaits a worker thread).
                raise HandlerExited("the handler raised GeneratorExit") from error
            finally:
                with slot.lock:
                    slot.finished = True
                    abandoned = slot.abandoned
                if abandoned:
                    # Hand the slot back without waiting for the loop: it may be
                    # stopped (never to run this) or gone, and a worker thread must
                    # never wait on it, or interpreter exit would wait for ever.
                    call_soon(limiter.release_on_behalf_of, slot)

        try:
            result = await anyio.to_thread.run_sync(
                run, abandon_on_cancel=True, limiter=self._threads
            )
        except BaseException:
            # Deliberate: cancelled (a timeout, shutdown) or the handler raised. Free
            # the slot now unless the thread still runs; then the thread frees it.
            with slot.lock:
                slot.abandoned = True
                release_now = slot.finished or not slot.started
            if release_now:
                limiter.release_on_behalf_of(slot)
            raise
        limiter.release_on_behalf_of(slot)
        return result[0]


def _loop_call_soon() -> Callable[..., None]:
    """A non-blocking ``call_soon_threadsafe`` into the running loop, for any thread.

    Once the loop is closed (or the trio run is over) the call does nothing: a slot
    of a bus that is gone needs no handing back.
    """
    schedule: Callable[..., object]
    if current_backend() == "trio":
        import trio

        schedule = trio.lowlevel.current_trio_token().run_sync_soon
    else:
        import asyncio

        schedule = asyncio.get_running_loop().call_soon_threadsafe

    def call_soon(function: Callable[..., object], *args: Any) -> None:
        # RuntimeError: asyncio's loop is closed, or trio's RunFinishedError.
        with contextlib.suppress(RuntimeError):
            schedule(function, *args)

    return call_soon


#: A GIL hand-over interval that keeps the loop's lag low beside busy worker threads.
SWITCH_INTERVAL = 0.0005
# Process-wide, and two buses may start or stop at once on two threads (each on its
# own event loop): the count and the saved value change together, under the lock.
_switch_lock = threading.Lock()
_switch_holders = 0
_switch_saved: float | None = None


def hold_switch_interval(seconds: float) -> None:
    """Shorten the interpreter's GIL switch interval to ``seconds`` while workers may be busy.

    On a GIL build a busy worker thread keeps the GIL until the event loop's thread
    has waited ``sys.getswitchinterval()`` (5 ms by default), which is then the loop's
    lag on every wake-up. Each running bus that asked for it (``Bus(switch_interval=)``)
    and has thread-offloaded stages holds the shorter interval; the interpreter's own
    value comes back when the last one stops. Free-threaded builds have no GIL to
    hand over and are left alone.
    """
    global _switch_holders, _switch_saved
    if _free_threaded():
        return
    with _switch_lock:
        if _switch_holders == 0:
            _switch_saved = sys.getswitchinterval()
        if sys.getswitchinterval() > seconds:
            sys.setswitchinterval(seconds)
        _switch_holders += 1


def release_switch_interval() -> None:
    """Undo one :func:`hold_switch_interval`."""
    global _switch_holders, _switch_saved
    if _free_threaded():
        return
    with _switch_lock:
        if _switch_holders == 0:
            return
        _switch_holders -= 1
        if _switch_holders == 0 and _switch_saved is not None:
            sys.setswitchinterval(_switch_saved)
            _switch_saved = None


def thread_pool_reason() -> str:
    """Why sync handlers on the worker thread pool do or do not run in parallel here."""
    if _free_threaded():
        return "this is a free-threaded build with the GIL off, so they run in parallel"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return (
            "this is a free-threaded build but the GIL is on (PYTHON_GIL=1, or an extension "
            "module without free-threading support turned it on), so CPU-bound ones take "
            "turns; offload='process' runs them in parallel"
        )
    return (
        "this build has the GIL, so CPU-bound ones take turns (blocking I/O still "
        "overlaps); offload='process' runs them in parallel, as does a free-threaded "
        "build (3.13t)"
    )


def _free_threaded() -> bool:
    return _runtime.FREE_THREADED  # read at each call: tests stand in another build
