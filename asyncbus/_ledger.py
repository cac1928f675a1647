"""A stage's ledger: where every envelope admitted to it ended, counted in one place."""

from __future__ import annotations

from ._dead_letters import DeadLetterReason

__all__ = ["Ledger"]


class Ledger:
    """Where every envelope admitted to a stage ended, counted in one place.

    ``published == acked + dead_lettered + abandoned + depth + in_flight`` at every
    moment (depth and in flight are the stage's); ``dropped``, ``expired`` and
    ``shed`` are parts of ``dead_lettered``; ``rejected`` (at the door) is never in
    ``published``; ``failed`` and ``retried`` count attempts, not envelopes;
    ``deferred`` counts the times an envelope was put back by a :class:`Defer`.
    """

    __slots__ = (
        "abandoned",
        "acked",
        "dead_lettered",
        "deferred",
        "dropped",
        "expired",
        "failed",
        "published",
        "rejected",
        "retried",
        "shed",
    )

    def __init__(self) -> None:
        self.published = self.acked = self.failed = self.retried = 0
        self.dead_lettered = self.rejected = self.dropped = self.expired = 0
        self.abandoned = self.shed = self.deferred = 0

    def dead(self, reason: DeadLetterReason) -> None:
        """Count one envelope dead-lettered for ``reason``."""
        self.dead_lettered += 1
        if reason is DeadLetterReason.DROPPED:
            self.dropped += 1
        elif reason is DeadLetterReason.EXPIRED:
            self.expired += 1
        elif reason is DeadLetterReason.OVERLOAD:
            self.shed += 1

    def dead_unsettled(self, reason: DeadLetterReason) -> None:
        """A dead letter the broker did not take: it comes back, so it ends abandoned."""
        self.dead_lettered -= 1
        if reason is DeadLetterReason.DROPPED:
            self.dropped -= 1
        elif reason is DeadLetterReason.EXPIRED:
            self.expired -= 1
        elif reason is DeadLetterReason.OVERLOAD:
            self.shed -= 1
        self.abandoned += 1

    def ack_lost(self) -> None:
        """An ack the broker never got: the envelope comes back, so it ends abandoned."""
        self.acked -= 1
        self.abandoned += 1
