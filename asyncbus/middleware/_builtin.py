"""How a built-in middleware is recognised, so a user's copy can replace the default, and
how a pass-through layer says which envelopes it acts on."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._envelope import Envelope
    from .._types import Middleware

__all__ = ["Applies", "applies_to", "mark_builtin"]

#: Whether a layer does anything for an envelope (``False``: it only calls the next one).
Applies = Callable[["Envelope"], bool]


def mark_builtin(layer: Middleware, kind: str, applies: Applies | None = None) -> Middleware:
    """Tag ``layer`` as the built-in ``kind``; returns it unchanged otherwise.

    :param applies: for a layer that passes most envelopes straight through, the test
        of the ones it acts on. A chain whose layers all have one tests them once per
        envelope and calls the handler directly when none applies (``_chain``), so the
        rule lives with the layer, never restated there.
    """
    layer.asyncbus_builtin = kind  # type: ignore[attr-defined]
    if applies is not None:
        layer.asyncbus_applies = applies  # type: ignore[attr-defined]
    return layer


def applies_to(layer: Middleware) -> Applies | None:
    """``layer``'s test of the envelopes it acts on; ``None``: it may act on any."""
    applies: Applies | None = getattr(layer, "asyncbus_applies", None)
    return applies
