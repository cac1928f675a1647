"""Expiry: an envelope past its ``ttl`` when picked up is dead-lettered, not handled."""

from __future__ import annotations

import operator
import time
from collections.abc import Sequence
from typing import Any

from .._dead_letters import DeadLetterReason
from .._envelope import Envelope
from .._types import Handler, Middleware
from .._verdicts import DeadLetterNow
from ._builtin import mark_builtin

__all__ = ["EXPIRED", "expire", "expired", "may_expire", "may_expire_any"]

_ttl = operator.attrgetter("ttl")

#: The verdict on an expired envelope. No exception happened: the reason says it all
#: (``error`` stays None).
EXPIRED = DeadLetterNow(DeadLetterReason.EXPIRED)


def expire() -> Middleware:
    """Dead-letter (reason ``expired``) an envelope whose ``ttl`` has passed."""

    def wrap(call_next: Handler) -> Handler:
        def handle(envelope: Envelope) -> Any:
            if envelope.ttl is not None and expired(envelope, time.time()):
                return _expired()
            return call_next(envelope)

        return handle

    return mark_builtin(wrap, "expire", applies=may_expire)


def may_expire(envelope: Envelope) -> bool:
    """Whether the expiry layer acts on ``envelope``: it has a ``ttl``."""
    return envelope.ttl is not None


def may_expire_any(envelopes: Sequence[Envelope]) -> bool:
    """Whether the expiry layer acts on any of ``envelopes`` (:func:`may_expire` for a
    whole batch at once, its tests run in C)."""
    return list(map(_ttl, envelopes)).count(None) != len(envelopes)


def expired(envelope: Envelope, now: float) -> bool:
    """Whether ``envelope`` (which has a ``ttl``) is past it at ``now`` (wall clock):
    the one rule, which the batch path asks too."""
    assert envelope.ttl is not None
    return now >= envelope.timestamp + envelope.ttl


async def _expired() -> DeadLetterNow:
    return EXPIRED
