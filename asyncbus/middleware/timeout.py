"""Timeouts: a handler that runs too long is cancelled and the attempt counts as failed."""

from __future__ import annotations

from typing import Any

import anyio

from .._checks import check_seconds
from .._envelope import Envelope
from .._exceptions import HandlerTimeout
from .._types import Handler, Middleware
from ._builtin import mark_builtin

__all__ = ["HandlerTimeout", "timeout"]


def timeout(seconds: float) -> Middleware:
    """Cancel the rest of the chain after ``seconds`` and raise :class:`HandlerTimeout`.

    Placed inside ``retry``, so a timed-out attempt can be retried; an offloaded
    handler's thread is abandoned (it runs to its end, its result discarded).

    :raises ConfigurationError: unless ``seconds`` is a finite number > 0.
    """

    seconds = check_seconds(seconds, "timeout: seconds")

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            with anyio.move_on_after(seconds) as scope:
                return await call_next(envelope)
            if scope.cancelled_caught:
                raise HandlerTimeout(f"handler took longer than {seconds:g}s")
            return None  # pragma: no cover - the body returned or raised

        return handle

    return mark_builtin(wrap, "timeout")
