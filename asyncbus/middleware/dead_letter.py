"""Dead-lettering: the outermost layer, where every failure that got this far ends."""

from __future__ import annotations

from typing import Any

from .._envelope import Envelope
from .._failures import handler_failure
from .._types import Handler, Middleware
from .._verdicts import DeadLetterNow
from ._builtin import mark_builtin

__all__ = ["dead_letter"]


def dead_letter() -> Middleware:
    """Dead-letter an envelope whose handling raised.

    The exception becomes the verdict :meth:`DeadLetterNow.for_failure` gives:
    ``Reject(reason)`` is ``rejected``, a :class:`HandlerTimeout` ``timeout``, any
    other exception ``handler_failed`` with the error's type, message and last frames.
    The exception never reaches the stage, so a failing handler never stops it. (The
    bus's own cancellation passes through: it stops the consumer.)
    """

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except BaseException as error:  # deliberate: a stray cancellation fails too
                failure = handler_failure(error)
                if failure is None:
                    raise  # the bus's own cancellation (or KeyboardInterrupt, ...)
                return DeadLetterNow.for_failure(failure)

        return handle

    return mark_builtin(wrap, "dead_letter")
