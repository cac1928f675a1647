"""Facts about the interpreter, and the one-call runner for scripts."""

from __future__ import annotations

import sys
import sysconfig
import types
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

__all__ = ["FREE_THREADED", "current_backend", "fast_checkpoint", "run"]

T = TypeVar("T")

#: True on a free-threaded CPython build (3.13t, 3.14t) running with the GIL disabled:
#: sync handlers on the worker pool then run truly in parallel.
FREE_THREADED: bool = (
    bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    and not getattr(sys, "_is_gil_enabled", lambda: True)()
)


@types.coroutine
def _asyncio_yield() -> Generator[None, None, None]:
    # What asyncio.sleep(0) does underneath: the task is stepped again on the next
    # loop iteration, and a pending cancellation is delivered then.
    yield


def current_backend() -> str:
    """Name the event loop running the calling task: ``"trio"`` or ``"asyncio"``.

    anyio's own rule when sniffio is not installed: trio is running when trio says so
    (``trio.lowlevel.current_task()`` raises outside a trio task), otherwise asyncio.
    trio cannot be running unless it was imported, so a bare install never imports it.
    """
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            pass
        else:
            return "trio"
    return "asyncio"


def fast_checkpoint() -> Callable[[], Awaitable[None]]:
    """The running backend's own checkpoint, looked up once.

    ``anyio.lowlevel.checkpoint`` finds the backend on every call; the bus yields on
    every publish and every envelope, so it resolves it once at start: on asyncio a
    bare yield (exactly ``asyncio.sleep(0)``), on trio ``trio.lowlevel.checkpoint``.
    """
    if current_backend() == "trio":
        import trio

        checkpoint: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint
        return checkpoint
    return _asyncio_yield


def run(main: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run ``main(*args)`` to completion on uvloop when it is installed, else on asyncio."""
    import anyio

    try:
        import uvloop  # noqa: F401
    except ImportError:
        options: dict[str, Any] = {}
    else:
        options = {"use_uvloop": True}
    return anyio.run(main, *args, backend="asyncio", backend_options=options)
