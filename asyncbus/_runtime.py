"""Facts about the interpreter, and the one-call runner for scripts."""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["FREE_THREADED", "run"]

T = TypeVar("T")

#: True on a free-threaded CPython build (3.13t, 3.14t) running with the GIL disabled:
#: sync handlers on the worker pool then run truly in parallel.
FREE_THREADED: bool = (
    bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    and not getattr(sys, "_is_gil_enabled", lambda: True)()
)


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
