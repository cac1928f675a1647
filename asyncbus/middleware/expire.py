"""Expiry: an envelope past its ``ttl`` when picked up is dead-lettered, not handled."""

from __future__ import annotations

import time
from typing import Any

from .._dead_letters import DeadLetterReason
from .._envelope import Envelope
from .._types import Handler, Middleware
from .._verdicts import DeadLetterNow
from ._builtin import mark_builtin

__all__ = ["expire", "may_expire"]

#: No exception happened: the reason says it all (``error`` stays None).
_EXPIRED = DeadLetterNow(DeadLetterReason.EXPIRED)


def expire() -> Middleware:
    """Dead-letter (reason ``expired``) an envelope whose ``ttl`` has passed."""

    def wrap(call_next: Handler) -> Handler:
        def handle(envelope: Envelope) -> Any:
            ttl = envelope.ttl
            if ttl is not None and time.time() >= envelope.timestamp + ttl:
                return _expired()
            return call_next(envelope)

        return handle

    return mark_builtin(wrap, "expire", applies=may_expire)


def may_expire(envelope: Envelope) -> bool:
    """Whether the expiry layer acts on ``envelope``: it has a ``ttl``."""
    return envelope.ttl is not None


async def _expired() -> DeadLetterNow:
    return _EXPIRED
