"""The envelope every message travels in, its ids, and the receipt of a publish."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice, repeat
from types import MappingProxyType
from typing import Any

__all__ = [
    "HEADER_KEY",
    "HEADER_PRIORITY",
    "HEADER_REPLAYED",
    "Envelope",
    "Receipt",
    "new_id",
]

#: Header set on an envelope that :meth:`DeadLetterQueue.replay` re-sent.
HEADER_REPLAYED = "asyncbus-replayed"
#: Header carrying the ``key=`` given to :meth:`Bus.publish` (ordering/partition key).
HEADER_KEY = "asyncbus-key"
#: Header carrying the ``priority=`` class given to :meth:`Bus.publish` (``"0"``..``"2"``).
HEADER_PRIORITY = "asyncbus-priority"

EMPTY_HEADERS: Mapping[str, str] = MappingProxyType({})

_node = os.urandom(3).hex()
_time_ns = time.time_ns
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
    stamp = (_time_ns() // 1000) << 24 | (next(_sequence) & 0xFFFFFF)
    return stamp.to_bytes(10, "big").hex() + _node


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

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickles for offload="process" (never for a wire): the read-only headers view
        # travels as a plain dict and is frozen again on arrival.
        return (
            _unpickle_envelope,
            (
                *(getattr(self, name) for name in _FIELDS[:3]),
                dict(self.headers),
                *(getattr(self, name) for name in _FIELDS[4:]),
            ),
        )


_FIELDS = tuple(Envelope.__dataclass_fields__)


def _unpickle_envelope(*values: Any) -> Envelope:
    fields = dict(zip(_FIELDS, values, strict=True))
    fields["headers"] = MappingProxyType(fields["headers"]) if fields["headers"] else EMPTY_HEADERS
    return Envelope(**fields)


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


# The bus builds an envelope and a receipt per publish: filling the slots directly is
# about twice as fast as the frozen dataclass __init__ (which also runs __post_init__).
_new = object.__new__
(
    _set_id,
    _set_topic,
    _set_payload,
    _set_headers,
    _set_timestamp,
    _set_ttl,
    _set_attempt,
    _set_slip,
    _set_correlation_id,
    _set_causation_id,
    _set_reply_to,
    _set_sender,
) = (getattr(Envelope, name).__set__ for name in Envelope.__dataclass_fields__)


def make_envelope(
    id: str,
    topic: str,
    payload: Any,
    headers: Mapping[str, str],
    timestamp: float,
    ttl: float | None,
    attempt: int,
    slip: tuple[str, ...],
    correlation_id: str,
    causation_id: str | None,
    reply_to: str | None,
    sender: str | None,
) -> Envelope:
    """Build an :class:`Envelope` from every field, skipping the dataclass machinery.

    (The slot setters are module globals: on CPython 3.11+ a cached global is read
    faster than keyword-only defaults are bound on every call.)
    """
    envelope: Envelope = _new(Envelope)
    _set_id(envelope, id)
    _set_topic(envelope, topic)
    _set_payload(envelope, payload)
    _set_headers(envelope, headers)
    _set_timestamp(envelope, timestamp)
    _set_ttl(envelope, ttl)
    _set_attempt(envelope, attempt)
    _set_slip(envelope, slip)
    _set_correlation_id(envelope, correlation_id)
    _set_causation_id(envelope, causation_id)
    _set_reply_to(envelope, reply_to)
    _set_sender(envelope, sender)
    return envelope


_set_receipt_id, _set_accepted, _set_rejected, _set_dropped = (
    getattr(Receipt, name).__set__ for name in Receipt.__dataclass_fields__
)


def make_envelopes(
    topic: str,
    payloads: Iterable[Any],
    headers: Mapping[str, str],
    timestamp: float,
    ttl: float | None,
    slip: tuple[str, ...],
    cause: tuple[str, str] | None,
    sender: str | None,
) -> list[Envelope]:
    """One new envelope per payload (``publish_many``), in order, sharing every other field.

    Their ids are :func:`new_id`'s, minted in one go: the same microsecond, then the
    process's sequence, so they sort in payload order. ``cause`` is the handled
    envelope's ``(correlation_id, id)``; without one each envelope is its own
    conversation.
    """
    values = list(payloads)
    count = len(values)
    # new_id()'s 26 characters: microseconds (14), sequence (6), node (6).
    prefix, node = f"{_time_ns() // 1000:014x}", _node
    ids = [f"{prefix}{number & 0xFFFFFF:06x}{node}" for number in islice(_sequence, count)]
    envelopes: list[Envelope] = list(map(_new, repeat(Envelope, count)))
    # Each slot filled for the whole batch by a loop in C (map), not one call at a time.
    _fill(map(_set_id, envelopes, ids))
    _fill(map(_set_topic, envelopes, repeat(topic, count)))
    _fill(map(_set_payload, envelopes, values))
    _fill(map(_set_headers, envelopes, repeat(headers, count)))
    _fill(map(_set_timestamp, envelopes, repeat(timestamp, count)))
    _fill(map(_set_ttl, envelopes, repeat(ttl, count)))
    _fill(map(_set_attempt, envelopes, repeat(1, count)))
    _fill(map(_set_slip, envelopes, repeat(slip, count)))
    if cause is None:
        _fill(map(_set_correlation_id, envelopes, ids))
        _fill(map(_set_causation_id, envelopes, repeat(None, count)))
    else:
        _fill(map(_set_correlation_id, envelopes, repeat(cause[0], count)))
        _fill(map(_set_causation_id, envelopes, repeat(cause[1], count)))
    _fill(map(_set_reply_to, envelopes, repeat(None, count)))
    _fill(map(_set_sender, envelopes, repeat(sender, count)))
    return envelopes


def make_receipts(envelopes: Sequence[Envelope], accepted: tuple[str, ...]) -> list[Receipt]:
    """A receipt naming ``accepted`` for each of ``envelopes``, in order."""
    count = len(envelopes)
    receipts: list[Receipt] = list(map(_new, repeat(Receipt, count)))
    _fill(map(_set_receipt_id, receipts, [envelope.id for envelope in envelopes]))
    _fill(map(_set_accepted, receipts, repeat(accepted, count)))
    _fill(map(_set_rejected, receipts, repeat((), count)))
    _fill(map(_set_dropped, receipts, repeat((), count)))
    return receipts


#: Runs an iterator to its end in C, keeping nothing.
_fill: Callable[[Iterable[Any]], None] = deque[Any](maxlen=0).extend


def make_receipt(
    id: str,
    accepted: tuple[str, ...],
    rejected: tuple[str, ...] = (),
    dropped: tuple[str, ...] = (),
) -> Receipt:
    """Build a :class:`Receipt`, skipping the dataclass machinery."""
    receipt: Receipt = _new(Receipt)
    _set_receipt_id(receipt, id)
    _set_accepted(receipt, accepted)
    _set_rejected(receipt, rejected)
    _set_dropped(receipt, dropped)
    return receipt


def replace_headers(envelope: Envelope, headers: Mapping[str, str]) -> Envelope:
    """A copy of ``envelope`` with ``headers`` (the same id: the same message)."""
    return make_envelope(
        envelope.id,
        envelope.topic,
        envelope.payload,
        headers,
        envelope.timestamp,
        envelope.ttl,
        envelope.attempt,
        envelope.slip,
        envelope.correlation_id,
        envelope.causation_id,
        envelope.reply_to,
        envelope.sender,
    )
