"""What counts as a handler's failure, and how a failure is told in a dead letter."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import traceback

import anyio

from ._runtime import current_backend

__all__ = [
    "HandlerCancelled",
    "HandlerExited",
    "describe_error",
    "handler_failure",
    "loop_closing",
    "short_traceback",
    "stray_cancellation",
]

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
    ``CancelledError`` in the awaiting handler although nothing cancelled the handler;
    so does a ``task.cancel()`` of the consumer's task made by anything but the bus
    (the handler itself, or another task). The bus turns it into this exception, so it
    is retried and dead-lettered like any other failure instead of stopping the
    consumer; ``__cause__`` is the original.
    """


class HandlerExited(Exception):
    """A handler raised ``GeneratorExit``: a failure like any exception, not a stop.

    ``__cause__`` is the original ``GeneratorExit``.
    """


#: The code of ``asyncio.Runner.close``: on the stack exactly while a runner tears its loop down.
_RUNNER_CLOSE = asyncio.Runner.close.__code__


def loop_closing() -> bool:
    """Whether the asyncio event loop running the caller is being torn down.

    ``asyncio.run`` ends, once its main coroutine returned or was interrupted, by
    cancelling every task still running and waiting until they all ended, from
    ``asyncio.Runner.close``; so do ``anyio.run``, ``uvloop.run``, uvicorn and the
    pytest plugins, which all run their loop with an ``asyncio.Runner``. The loop
    itself tells nothing then (it is neither closed nor closing until they all ended,
    and async generators are shut down only afterwards), but ``Runner.close`` is on
    the stack below the task being stepped, and nowhere else is. A task that took
    that cancellation for a stray one and went on would keep the process alive for
    ever. Always ``False`` on trio, whose tasks cannot outlive their nursery.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _RUNNER_CLOSE:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def stray_cancellation() -> bool:
    """Whether the cancellation exception being handled is not the bus's own.

    Call it only while handling the backend's cancellation exception. The bus stops
    its tasks through cancel scopes alone, so a cancellation is its own (or that of
    any enclosing scope) exactly when a scope around the calling task was cancelled.
    Anything else is stray: on asyncio, a ``task.cancel()`` made by someone else, or
    a ``CancelledError`` of something else that was awaited. A stray cancellation
    requested on the calling task itself is taken back (``uncancel``): the task was
    not asked to stop by its owner, and goes on.

    While the event loop is being torn down (:func:`loop_closing`) no cancellation is
    stray: every task must end, the bus's included.
    """
    if anyio.current_effective_deadline() == -math.inf:
        return False  # a scope around us was cancelled: this is ours
    if loop_closing():
        return False
    if current_backend() == "asyncio":
        task = asyncio.current_task()
        if task is not None:
            while task.cancelling():
                task.uncancel()
    return True


def handler_failure(error: BaseException) -> Exception | None:
    """What the bus treats as the handler's failure for ``error``, ``None`` to re-raise it.

    An ``Exception`` is a failure as it is, and so is ``GeneratorExit`` (as a
    :class:`HandlerExited`). A cancellation exception is the bus's own (shutdown, a
    stage timeout, any enclosing cancel scope) when a cancel scope around the calling
    task was cancelled; any other is a :class:`HandlerCancelled` failure (see
    :func:`stray_cancellation`). ``KeyboardInterrupt`` and ``SystemExit`` (and any
    other ``BaseException``) are not failures: ``None``, and the consumer stops the
    bus with them (the host's ``halt``).
    """
    if isinstance(error, Exception):
        return error
    if isinstance(error, GeneratorExit):
        exited = HandlerExited("the handler raised GeneratorExit")
        exited.__cause__ = error
        return exited
    if not isinstance(error, anyio.get_cancelled_exc_class()) or not stray_cancellation():
        return None
    failure = HandlerCancelled(
        f"the handler raised {type(error).__name__}"
        f"{f' ({error})' if str(error) else ''} without being cancelled"
    )
    failure.__cause__ = error
    return failure
