"""What a publish does at a full stage's door."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Backpressure"]


class Backpressure(StrEnum):
    """What a publish does when it finds a stage's queue full."""

    #: Wait for room (up to the publish ``timeout``, then :class:`PublishTimeout`).
    BLOCK = "block"
    #: Enqueue nothing for this stage; the receipt lists it in ``rejected``.
    REJECT = "reject"
    #: Do not enqueue the new envelope; it is dead-lettered ``dropped``.
    DROP_NEWEST = "drop_newest"
    #: Evict (and dead-letter ``dropped``) the oldest queued envelope, admit the new one.
    DROP_OLDEST = "drop_oldest"
