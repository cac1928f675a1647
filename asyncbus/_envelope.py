"""The envelope every message travels in, its ids, and the receipt of a publish."""

from __future__ import annotations

import dataclasses
import itertools
import os
import sysconfig
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import islice
from types import MappingProxyType
from typing import Any, cast

__all__ = [
    "HEADER_KEY",
    "HEADER_PRIORITY",
    "HEADER_REPLAYED",
    "HEADER_WIRE",
    "WIRE_FORMATS",
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
#: Header asking a broker transport to write the envelope for clients that know nothing
#: of asyncbus: ``"plain"`` (the payload alone as the body, the rest in the broker's own
#: fields), ``"cloudevents"`` (a CloudEvent in binary mode) or ``"cloudevents-structured"``
#: (in structured mode). Only a publish is written so; a retry is in the bus's own format.
HEADER_WIRE = "asyncbus-wire"
#: The values :data:`HEADER_WIRE` takes.
WIRE_FORMATS = ("plain", "cloudevents", "cloudevents-structured")

EMPTY_HEADERS: Mapping[str, str] = MappingProxyType({})

_node = os.urandom(3).hex()
_time_ns = time.time_ns
# Any thread takes ids (an Envelope made in a worker thread). One next() on a count is
# atomic on every build (a compare-and-swap on free-threaded ones); a run of numbers
# for a batch is one call too (see _batch_ids).
_sequence = itertools.count()


def _id_tails(node: str) -> list[str]:
    # An id's last two digits of sequence and its node, for each value of the last byte:
    # make_envelopes writes a batch's ids as a shared head plus one of these.
    return [f"{low:02x}{node}" for low in range(256)]


_tails = _id_tails(_node)


def _reseed() -> None:
    # A forked child must not mint the same ids as its parent.
    global _node, _sequence, _tails
    _node = os.urandom(3).hex()
    _sequence = itertools.count()
    _tails = _id_tails(_node)


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

    It is truthy when no stage rejected or dropped the envelope. A publish given
    ``delay=`` or ``at=`` reached no stage yet: its receipt says when it is due
    (``scheduled``, an aware UTC datetime); ``id`` cancels it (``bus.cancel_scheduled``).
    Nor did a publish given ``connection=``: it names no stage, and ``id`` is the id its
    envelope is delivered with once the transaction commits.
    """

    id: str
    accepted: tuple[str, ...] = ()
    rejected: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    scheduled: datetime | None = None

    def __bool__(self) -> bool:
        return not (self.rejected or self.dropped)


# The bus builds an envelope and a receipt per publish, and publish_many a hundred at a
# time. A frozen dataclass's __init__ sets each field through object.__setattr__ (and
# runs __post_init__); calling each slot's setter is about twice as fast, and cheaper
# still is a plain twin class with the same slots: its __init__ stores each field with
# a specialised attribute store, then the instance becomes what it was built to be by
# __class__ assignment (allowed because the two layouts are identical, checked below).
# The result is an ordinary Envelope (type(e) is Envelope, equal and hashed as one).


class _EnvelopeSlots:
    """An :class:`Envelope` under construction: the same slots, writable (see above)."""

    __slots__ = (  # noqa: RUF023 (Envelope's order: the layouts must match)
        "id",
        "topic",
        "payload",
        "headers",
        "timestamp",
        "ttl",
        "attempt",
        "slip",
        "correlation_id",
        "causation_id",
        "reply_to",
        "sender",
    )

    def __init__(
        self,
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
    ) -> None:
        self.id = id
        self.topic = topic
        self.payload = payload
        self.headers = headers
        self.timestamp = timestamp
        self.ttl = ttl
        self.attempt = attempt
        self.slip = slip
        self.correlation_id = correlation_id
        self.causation_id = causation_id
        self.reply_to = reply_to
        self.sender = sender
        self.__class__ = Envelope  # type: ignore[assignment]


class _ReceiptSlots:
    """A :class:`Receipt` under construction (see :class:`_EnvelopeSlots`)."""

    __slots__ = ("id", "accepted", "rejected", "dropped", "scheduled")  # noqa: RUF023

    def __init__(
        self,
        id: str,
        accepted: tuple[str, ...],
        rejected: tuple[str, ...] = (),
        dropped: tuple[str, ...] = (),
    ) -> None:
        self.id = id
        self.accepted = accepted
        self.rejected = rejected
        self.dropped = dropped
        self.scheduled = None
        self.__class__ = Receipt  # type: ignore[assignment]


# __class__ assignment needs the same slots in the same order: a field added to the
# dataclass without its twin fails here, at import, not on the first publish.
# (A raise, not an assert: python -O must not skip it.)
if _EnvelopeSlots.__slots__ != Envelope.__slots__:  # pragma: no cover
    raise RuntimeError("_EnvelopeSlots must have Envelope's slots, in its order")
if _ReceiptSlots.__slots__ != Receipt.__slots__:  # pragma: no cover
    raise RuntimeError("_ReceiptSlots must have Receipt's slots, in its order")

_new = object.__new__

#: On a free-threaded build (CPython 3.13t) every ``__class__`` assignment stops all the
#: interpreter's threads until it is done: each publish paused every busy worker, and
#: waited for each one the OS had descheduled (measured on 2 cores: the overhead per
#: message 1.7-2x, and 17x while other processes kept the cores busy). There each field
#: is stored by its slot's own setter instead: a third slower on one thread, and
#: nothing stops.
CLASS_ASSIGNMENT_STOPS_THE_WORLD = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))

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
) = (Envelope.__dict__[name].__set__ for name in Envelope.__slots__)
_set_receipt_id, _set_accepted, _set_rejected, _set_dropped, _set_scheduled = (
    Receipt.__dict__[name].__set__ for name in Receipt.__slots__
)


def _envelope_by_setters(
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


def _receipt_by_setters(
    id: str,
    accepted: tuple[str, ...],
    rejected: tuple[str, ...] = (),
    dropped: tuple[str, ...] = (),
) -> Receipt:
    receipt: Receipt = _new(Receipt)
    _set_receipt_id(receipt, id)
    _set_accepted(receipt, accepted)
    _set_rejected(receipt, rejected)
    _set_dropped(receipt, dropped)
    _set_scheduled(receipt, None)
    return receipt


#: ``make_envelope(every field, in order) -> Envelope``, skipping the dataclass machinery.
make_envelope = cast(
    "Callable[[str, str, Any, Mapping[str, str], float, float | None, int, "
    "tuple[str, ...], str, str | None, str | None, str | None], Envelope]",
    _envelope_by_setters if CLASS_ASSIGNMENT_STOPS_THE_WORLD else _EnvelopeSlots,
)
#: ``make_receipt(id, accepted, rejected=(), dropped=()) -> Receipt``, likewise.
make_receipt = cast(
    "Callable[..., Receipt]",
    _receipt_by_setters if CLASS_ASSIGNMENT_STOPS_THE_WORLD else _ReceiptSlots,
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
    if not count:
        return []
    ids = _batch_ids(count)
    correlation, causation = (None, None) if cause is None else cause
    if CLASS_ASSIGNMENT_STOPS_THE_WORLD:
        return [
            make_envelope(
                id,
                topic,
                value,
                headers,
                timestamp,
                ttl,
                1,
                slip,
                id if correlation is None else correlation,
                causation,
                None,
                sender,
            )
            for id, value in zip(ids, values, strict=True)
        ]
    # A plain loop of slot stores: no __init__ call per envelope (a third cheaper).
    envelopes: list[Envelope] = []
    append = envelopes.append
    twin, final = _EnvelopeSlots, Envelope
    for id, value in zip(ids, values, strict=True):
        envelope = _new(twin)
        envelope.id = id
        envelope.topic = topic
        envelope.payload = value
        envelope.headers = headers
        envelope.timestamp = timestamp
        envelope.ttl = ttl
        envelope.attempt = 1
        envelope.slip = slip
        envelope.correlation_id = id if correlation is None else correlation
        envelope.causation_id = causation
        envelope.reply_to = None
        envelope.sender = sender
        envelope.__class__ = final  # type: ignore[assignment]
        append(envelope)  # type: ignore[arg-type]
    return envelopes


def _batch_ids(count: int) -> list[str]:
    """``count`` ids of :func:`new_id`'s format, in order, for one batch.

    new_id()'s 20 hex digits of (microseconds << 24 | sequence), then the node. The
    batch takes ``count`` numbers of the sequence and counts up from the first one's
    stamp, so the ids sort in batch order (each id is the first one's plus its
    number's distance from the first number: unique even when another thread's
    numbers fell between them). Within a run that shares all but the last byte, each
    id is one string concatenation, in C: the run's 18 digits of head plus a
    precomputed tail (the last 2 digits and the node).
    """
    # One call takes the batch's numbers: other threads take numbers too (an Envelope
    # made in a worker thread). With the GIL none can between two numbers of one call;
    # on a free-threaded build one can, and the batch then has gaps.
    taken = list(islice(_sequence, count))
    first = taken[0]
    stamp = (_time_ns() // 1000) << 24 | (first & 0xFFFFFF)
    if taken[-1] - first != count - 1:
        node = _node
        return [(stamp + number - first).to_bytes(10, "big").hex() + node for number in taken]
    ids: list[str] = []
    while count:
        low = stamp & 0xFF
        run = min(count, 256 - low)
        head = hex(_ID_MARK | stamp)[3:21]  # (the leading 1 bit keeps the zero padding)
        ids += map(head.__add__, _tails[low : low + run])
        stamp += run
        count -= run
    return ids


#: The bit above new_id()'s 80 (see _batch_ids).
_ID_MARK = 1 << 80


def make_receipts(envelopes: Sequence[Envelope], accepted: tuple[str, ...]) -> list[Receipt]:
    """A receipt naming ``accepted`` for each of ``envelopes``, in order."""
    if CLASS_ASSIGNMENT_STOPS_THE_WORLD:
        return [make_receipt(envelope.id, accepted) for envelope in envelopes]
    # As in make_envelopes: slot stores in a loop, no __init__ call per receipt.
    receipts: list[Receipt] = []
    append = receipts.append
    twin, final = _ReceiptSlots, Receipt
    for envelope in envelopes:
        receipt = _new(twin)
        receipt.id = envelope.id
        receipt.accepted = accepted
        receipt.rejected = ()
        receipt.dropped = ()
        receipt.scheduled = None
        receipt.__class__ = final  # type: ignore[assignment]
        append(receipt)  # type: ignore[arg-type]
    return receipts


def replace_headers(
    envelope: Envelope, headers: Mapping[str, str], topic: str | None = None
) -> Envelope:
    """A copy of ``envelope`` with ``headers`` (and ``topic``, if given): the same id,
    the same message."""
    return make_envelope(
        envelope.id,
        envelope.topic if topic is None else topic,
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
