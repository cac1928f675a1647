"""The groups a broker routes to: the bus's request inboxes among them, and the dead
letter of a publish that reached none."""

from __future__ import annotations

import time

from ..._dead_letters import DeadLetter, DeadLetterReason
from ..._envelope import Envelope

__all__ = ["INBOX_GROUP_PREFIX", "unrouted_entry"]

#: Groups of the bus's request inboxes (``_reply.<bus instance>``, one per process):
#: transports keep what such a group has in the broker only while its process lives.
INBOX_GROUP_PREFIX = "_reply."


def unrouted_entry(envelope: Envelope) -> DeadLetter:
    """The dead letter of an envelope published where no group matches its topic."""
    return DeadLetter(envelope, DeadLetterReason.NO_SUBSCRIBERS, None, None, 0, time.time())
