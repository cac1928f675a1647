"""The shared vocabulary: what a handler and a middleware are."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from ._envelope import Envelope

__all__ = ["Handler", "Middleware", "middleware"]

#: The innermost shape of everything in a stage's chain: take an envelope, return a result.
Handler: TypeAlias = "Callable[[Envelope], Awaitable[Any]]"
#: Wraps a handler into another; called once per stage when the chain is built.
Middleware: TypeAlias = "Callable[[Handler], Handler]"


def middleware(
    function: Callable[[Envelope, Handler], Awaitable[Any]],
) -> Middleware:
    """Turn ``async def mw(env, call_next)`` into a :data:`Middleware`.

    The result is called once per stage with the next handler of the chain and
    returns the wrapped handler; per message only ``function`` runs.
    """

    def wrap(call_next: Handler) -> Handler:
        def handle(envelope: Envelope) -> Awaitable[Any]:
            return function(envelope, call_next)

        return handle

    wrap.__name__ = getattr(function, "__name__", "middleware")
    wrap.__qualname__ = getattr(function, "__qualname__", "middleware")
    wrap.__doc__ = function.__doc__
    return wrap
