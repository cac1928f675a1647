"""What counts as a handler's failure, and how a failure is told in a dead letter."""

from __future__ import annotations

import asyncio
import math
import os
import traceback

import anyio

from ._runtime import current_backend

__all__ = ["HandlerCancelled", "describe_error", "handler_failure", "short_traceback"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def describe_error(error: BaseException) -> str:
    """``"Type: message"``: what :attr:`DeadLetter.error` holds."""
    return f"{type(error).__name__}: {error}"


def short_traceback(error: BaseException) -> str | None:
    """The last three frames of ``error``'s traceback outside asyncbus, else ``None``."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith(_PACKAGE_DIR)
    ][-3:]
    return "".join(traceback.format_list(frames)).rstrip() if frames else None


class HandlerCancelled(Exception):
    """A handler raised a cancellation that was not its own (a failure, not a stop).

    On asyncio, awaiting a task or future that someone else cancelled raises
    ``CancelledError`` in the awaiting handler although nothing cancelled the handler.
    The bus turns it into this exception, so it is retried and dead-lettered like any
    other failure instead of stopping the consumer; ``__cause__`` is the original.
    """


def handler_failure(error: BaseException) -> Exception | None:
    """What the bus treats as the handler's failure for ``error``, ``None`` to re-raise it.

    An ``Exception`` is a failure as it is. A cancellation exception is the bus's own
    (shutdown, a stage timeout, any enclosing cancel scope) when a cancel scope around
    the calling task was cancelled, or, on asyncio, when the task itself was asked to
    cancel; otherwise it came from something else that was cancelled, and it is a
    :class:`HandlerCancelled` failure. Anything else (``KeyboardInterrupt``,
    ``SystemExit``, ...) is re-raised.
    """
    if isinstance(error, Exception):
        return error
    if not isinstance(error, anyio.get_cancelled_exc_class()):
        return None
    if anyio.current_effective_deadline() == -math.inf:
        return None  # a scope around us was cancelled: this is ours
    if current_backend() == "asyncio":
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return None  # task.cancel() was called on this very task
    failure = HandlerCancelled(
        f"the handler raised {type(error).__name__}"
        f"{f' ({error})' if str(error) else ''} without being cancelled"
    )
    failure.__cause__ = error
    return failure
