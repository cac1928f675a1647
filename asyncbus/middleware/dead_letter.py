"""Dead-lettering: the outermost layer, where every failure that got this far ends."""

from __future__ import annotations

from typing import Any

from .._dispatch import current_dispatch, handler_failure
from .._envelope import Envelope
from .._types import Handler, Middleware
from ._builtin import mark_builtin

__all__ = ["dead_letter"]


def dead_letter() -> Middleware:
    """Dead-letter an envelope whose handling raised.

    ``Reject(reason)`` becomes ``rejected``, a handler timeout ``timeout``, any other
    exception ``handler_failed`` with the error's type, message and last frames. The
    exception never reaches the stage, so a failing handler never stops it.
    """

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except BaseException as error:  # deliberate: a stray cancellation fails too
                dispatch = current_dispatch()
                failure = handler_failure(error)
                if dispatch is None or failure is None:
                    raise  # outside a bus, or the bus's own cancellation
                dispatch.fail(failure)
                return None

        return handle

    return mark_builtin(wrap, "dead_letter")
