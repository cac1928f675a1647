"""The groups a broker routes to: the bus's request inboxes among them, and the dead
letter of a publish that reached none."""

from __future__ import annotations

import time

from ..._dead_letters import DeadLetter, DeadLetterReason
from ..._envelope import Envelope

__all__ = ["INBOX_GROUP_PREFIX", "INBOX_TTL", "is_inbox", "unrouted_entry"]

#: Groups of the bus's request inboxes (``_reply.<bus instance>``, one per process):
#: transports keep what such a group has in the broker only while its process lives.
INBOX_GROUP_PREFIX = "_reply."

#: Seconds a request inbox stays in the broker after its process stopped reading it
#: (died: one that leaves deletes its inbox at once). Each broker keeps it its own way
#: (a sorted set of deadlines, a consumer's inactivity threshold, a queue's expiry, a
#: row's deadline); the span is the same everywhere.
INBOX_TTL = 300.0


def is_inbox(group: str) -> bool:
    """Whether ``group`` is a bus's request inbox (one process's, short-lived)."""
    return group.startswith(INBOX_GROUP_PREFIX)


def unrouted_entry(envelope: Envelope) -> DeadLetter:
    """The dead letter of an envelope published where no group matches its topic."""
    return DeadLetter(envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0, time.time())
