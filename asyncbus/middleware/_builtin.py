"""How a built-in middleware is recognised, so a user's copy can replace the default."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._types import Middleware

__all__ = ["mark_builtin"]


def mark_builtin(layer: Middleware, kind: str) -> Middleware:
    """Tag ``layer`` as the built-in ``kind``; returns it unchanged otherwise."""
    layer.asyncbus_builtin = kind  # type: ignore[attr-defined]
    return layer
