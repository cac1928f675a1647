"""The envelope every message travels in, its ids, and the receipt of a publish."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "HEADER_KEY",
    "HEADER_REPLAYED",
    "Envelope",
    "Receipt",
    "new_id",
]

#: Header set on an envelope that :meth:`DeadLetterQueue.replay` re-sent.
HEADER_REPLAYED = "asyncbus-replayed"
#: Header carrying the ``key=`` given to :meth:`Bus.publish` (ordering/partition key).
HEADER_KEY = "asyncbus-key"

EMPTY_HEADERS: Mapping[str, str] = MappingProxyType({})

_node = os.urandom(3).hex()
_sequence = itertools.count()


def _reseed() -> None:
    # A forked child must not mint the same ids as its parent.
    global _node, _sequence
    _node = os.urandom(3).hex()
    _sequence = itertools.count()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """Return a new envelope id: unique, and sortable by creation time.

    Microseconds since the epoch, then a per-process sequence, then a random
    per-process node, all hex (26 characters).
    """
    return f"{time.time_ns() // 1000:014x}{next(_sequence) & 0xFFFFFF:06x}{_node}"


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message on its way through the bus.

    :ivar id: unique, time-sortable id; the same across retries and fan-out.
    :ivar topic: the topic it was published to.
    :ivar payload: what the handler receives.
    :ivar headers: string metadata; names the bus owns begin ``asyncbus-``.
    :ivar timestamp: epoch seconds at first publish (kept across retries and slip hops).
    :ivar ttl: seconds after ``timestamp`` at which it expires, ``None`` for never.
    :ivar attempt: 1 on first delivery, incremented by each retry.
    :ivar slip: the topics still ahead of it on its routing slip.
    :ivar correlation_id: shared by every envelope of one conversation (its own id
        when none was given).
    :ivar causation_id: the id of the envelope whose handling produced this one.
    :ivar reply_to: where the result of the route is awaited (request/reply).
    :ivar sender: free-form name of the publisher.
    """

    id: str = field(default_factory=new_id)
    topic: str = ""
    payload: Any = None
    headers: Mapping[str, str] = field(default_factory=lambda: EMPTY_HEADERS)
    timestamp: float = field(default_factory=time.time)
    ttl: float | None = None
    attempt: int = 1
    slip: tuple[str, ...] = ()
    correlation_id: str = ""
    causation_id: str | None = None
    reply_to: str | None = None
    sender: str | None = None

    def __post_init__(self) -> None:
        if not self.correlation_id:
            object.__setattr__(self, "correlation_id", self.id)

    def expired(self, now: float | None = None) -> bool:
        """Tell whether the envelope's ``ttl`` has passed at ``now`` (default: the clock)."""
        if self.ttl is None:
            return False
        return (time.time() if now is None else now) >= self.timestamp + self.ttl

    def evolve(self, **changes: Any) -> Envelope:
        """Return a copy with the given fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Receipt:
    """What a publish did, stage by stage (stage names are ``"pattern@group"``).

    It is truthy when no stage rejected or dropped the envelope.
    """

    id: str
    accepted: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return not (self.rejected or self.dropped)
