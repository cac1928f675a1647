"""The context a middleware sees while one envelope is being handled.

Each consumer task owns one :class:`Dispatch`, set once in a context variable and
reset per envelope, so built-in middleware can settle the envelope (dead-letter it,
schedule a retry) without the chain's signature carrying anything but the envelope.
"""

from __future__ import annotations

import math
import os
import traceback
from contextvars import ContextVar
from typing import TYPE_CHECKING

import anyio

from ._dead_letters import DeadLetter, DeadLetterReason
from ._exceptions import DecodeError, Reject
from ._runtime import current_backend

if TYPE_CHECKING:
    from ._bus import Bus
    from ._envelope import Envelope
    from ._stage import Stage

__all__ = [
    "Dispatch",
    "HandlerCancelled",
    "Outcome",
    "current_dispatch",
    "describe_error",
    "handled_envelope",
    "handler_failure",
    "short_traceback",
]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_current: ContextVar[Dispatch | None] = ContextVar("asyncbus_dispatch", default=None)


class Outcome:
    """How a dispatch ended when the chain returned (``None`` means: ack it)."""

    DEFERRED = "deferred"
    DEAD = "dead"
    SKIPPED = "skipped"


def current_dispatch() -> Dispatch | None:
    """Return the dispatch being handled by the calling task, or ``None`` outside one."""
    return _current.get()


def handled_envelope() -> Envelope | None:
    """The envelope the calling consumer is handling now, ``None`` outside a handler."""
    dispatch = _current.get()
    return dispatch.envelope if dispatch is not None else None


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
        import asyncio

        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return None  # task.cancel() was called on this very task
    failure = HandlerCancelled(
        f"the handler raised {type(error).__name__}"
        f"{f' ({error})' if str(error) else ''} without being cancelled"
    )
    failure.__cause__ = error
    return failure


class Dispatch:
    """One consumer task's view of the envelope it is handling now.

    :ivar stage: the stage the consumer belongs to.
    :ivar bus: the bus that owns the stage.
    :ivar envelope: the envelope being handled.
    :ivar outcome: ``None`` while it will be acked, else an :class:`Outcome` value.
    """

    __slots__ = ("bus", "cause", "dead", "delay", "envelope", "outcome", "stage")

    def __init__(self, stage: Stage, bus: Bus) -> None:
        self.stage = stage
        self.bus = bus
        self.envelope: Envelope | None = None
        self.outcome: str | None = None
        #: The dead letter recorded for the current envelope, if it died.
        self.dead: DeadLetter | None = None
        #: What failed the current envelope's attempt, when it died or will be retried.
        self.cause: BaseException | None = None
        #: Seconds until the retry, when one is scheduled.
        self.delay: float | None = None

    def activate(self) -> None:
        """Make this the calling task's dispatch (once, when the consumer starts)."""
        _current.set(self)

    def dead_letter(
        self,
        reason: DeadLetterReason,
        error: str | None = None,
        *,
        failed: bool = False,
        cause: BaseException | None = None,
    ) -> None:
        """Dead-letter the current envelope now; the consumer will not ack it.

        :param failed: count a failed attempt (the handler raised).
        :param cause: the exception, chained to a requester's :class:`HandlerError`.
        """
        if self.outcome is not None or self.envelope is None:
            return
        self.outcome = Outcome.DEAD
        self.cause = cause
        self.dead = self.stage.settle_dead(self.envelope, reason, error, failed=failed, cause=cause)

    def fail(self, error: BaseException) -> None:
        """Dead-letter the current envelope for ``error`` (a handler's exception)."""
        from .middleware.timeout import HandlerTimeout

        if isinstance(error, Reject):
            reason = DeadLetterReason.REJECTED
            text = f"Reject: {error.reason}"
        elif isinstance(error, DecodeError):
            reason = DeadLetterReason.REJECTED
            text = f"DecodeError: {error}"
        elif isinstance(error, HandlerTimeout):
            reason = DeadLetterReason.TIMEOUT
            text = describe_error(error)
        else:
            reason = DeadLetterReason.HANDLER_FAILED
            text = describe_error(error)
        self.dead_letter(reason, text, failed=True, cause=error)

    def skip(self) -> None:
        """Ack the current envelope without handling it further (nothing is forwarded)."""
        if self.outcome is None:
            self.outcome = Outcome.SKIPPED

    def retry(self, delay: float, cause: BaseException | None = None) -> None:
        """Re-enter the current envelope into its own stage after ``delay`` seconds.

        The envelope stays in flight (for the ledger and ``drain``) while it waits.

        :param cause: the failure that made the attempt fail (logged at DEBUG, and told
            to an instrumented bus's observers).
        """
        if self.outcome is not None or self.envelope is None:
            return
        self.outcome = Outcome.DEFERRED
        self.cause = cause
        self.delay = delay
        self.bus.failure_log.retrying(self.stage.name, self.envelope, delay, cause)
        self.stage.schedule_retry(self.envelope, delay)
