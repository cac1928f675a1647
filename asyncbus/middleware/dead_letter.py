"""Dead-lettering: the outermost layer, where every failure that got this far ends."""

from __future__ import annotations

from typing import Any

from .._envelope import Envelope
from .._types import Handler, Middleware
from .._verdicts import escaped_verdict
from ._builtin import mark_builtin

__all__ = ["dead_letter"]


def dead_letter() -> Middleware:
    """Dead-letter an envelope whose handling raised.

    The exception becomes the verdict the consumer would give it (``escaped_verdict``,
    :meth:`DeadLetterNow.for_failure`):
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
                verdict = escaped_verdict(error)  # (re-raises the bus's own cancellation)
                if verdict is None:
                    raise  # KeyboardInterrupt, SystemExit: the consumer stops the bus
                return verdict

        return handle

    # Outermost, it decides exactly as the consumer does with what escapes a chain: the
    # chain leaves it out there (a user's own dead-letter layer is never left out).
    wrap.asyncbus_as_the_consumer = True  # type: ignore[attr-defined]
    return mark_builtin(wrap, "dead_letter")
