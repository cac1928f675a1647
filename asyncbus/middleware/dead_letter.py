"""Dead-lettering: the outermost layer, where every failure that got this far ends."""

from __future__ import annotations

from typing import Any

from .._dispatch import current_dispatch
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
            except Exception as error:
                dispatch = current_dispatch()
                if dispatch is None:
                    raise
                dispatch.fail(error)
                return None

        return handle

    return mark_builtin(wrap, "dead_letter")
