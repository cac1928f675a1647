"""A user's deferring middleware, written with the public API only, for the Defer tests."""

from __future__ import annotations

from typing import Any

from asyncbus import Defer, Envelope, Handler, Middleware

__all__ = ["defer_first_runs"]


def defer_first_runs(times: int, delay: float = 0.0) -> Middleware:
    """A user's limiter: puts each envelope back ``times`` times (for ``delay`` seconds
    each) before letting it run."""
    seen: dict[str, int] = {}

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            runs = seen.get(envelope.id, 0)
            seen[envelope.id] = runs + 1
            if runs < times:
                return Defer(delay)
            return await call_next(envelope)

        return handle

    return wrap
