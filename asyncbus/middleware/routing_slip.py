"""Routing slips and replies: what happens to a handler's return value."""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Sequence
from typing import Any

from .._envelope import Envelope
from .._handling import current_handling
from .._types import Handler, Middleware
from .._verdicts import Verdict
from ._builtin import mark_builtin

__all__ = ["forwards", "forwards_any", "routing_slip"]

_slip = operator.attrgetter("slip")
_reply_to = operator.attrgetter("reply_to")


def routing_slip() -> Middleware:
    """Forward a handled envelope's result along its slip, or reply to its requester.

    After the handler succeeded, its return value (``None`` included) is published
    once to the next topic of ``envelope.slip`` as a new envelope (new id, same
    correlation id, ``causation_id`` = this id, same timestamp and ttl). At the end of
    the slip the return value answers a pending :meth:`Bus.request`. Nothing is
    forwarded when an inner layer returned a verdict (dead letter, retry, skip).
    """

    def wrap(call_next: Handler) -> Handler:
        async def handle_and_forward(envelope: Envelope) -> Any:
            result = await call_next(envelope)
            if isinstance(result, Verdict):
                return result
            handling = current_handling()
            if handling is not None:
                await handling.host.forward(envelope, result)
            return result

        def handle(envelope: Envelope) -> Awaitable[Any]:
            # Most envelopes go nowhere after their handler: no extra frame for them.
            # (``forwards``, inlined: this runs once per envelope.)
            if envelope.slip or envelope.reply_to is not None:
                return handle_and_forward(envelope)
            return call_next(envelope)

        return handle

    return mark_builtin(wrap, "routing_slip", applies=forwards)


def forwards(envelope: Envelope) -> bool:
    """Whether the routing-slip layer acts on ``envelope``: it has a slip or a requester."""
    return bool(envelope.slip) or envelope.reply_to is not None


def forwards_any(envelopes: Sequence[Envelope]) -> bool:
    """Whether the routing-slip layer acts on any of ``envelopes`` (:func:`forwards`
    for a whole batch at once, its tests run in C)."""
    return any(map(_slip, envelopes)) or list(map(_reply_to, envelopes)).count(None) != len(
        envelopes
    )
