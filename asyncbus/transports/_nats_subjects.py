"""What the NATS transport names on the server, and what fits in a subject.

A prefix names a stream (:func:`stream_name`), a (pattern, group) its durable consumer
(:func:`consumer_name`), an envelope id a subject token (:func:`id_token`). A subject
travels in the protocol line, which the server holds to 4 KiB and closes the connection
of a longer one: :func:`subject_limits` is what topics and patterns fit with a prefix.
"""

from __future__ import annotations

import hashlib
import re

from .._exceptions import ConfigurationError
from .base import TopicLimits

__all__ = [
    "check_subject_text",
    "consumer_name",
    "id_token",
    "stream_name",
    "subject_limits",
]

#: The server's longest protocol line (its default ``max_control_line``): a command
#: longer than that (a publish to a longer subject) makes it close the connection.
_CONTROL_LINE = 4096
#: Room kept on that line for what surrounds a subject (verb, reply subject, sizes).
_LINE_ROOM = 256
#: Longest durable consumer name (:func:`consumer_name`).
_NAME_MAX = 48 + 1 + 32 + 1 + 12

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: What a NATS subject cannot hold: the protocol splits on whitespace.
_NOT_IN_SUBJECT_CLASS = r"[\s\x00-\x1f\x7f]"
_NOT_IN_SUBJECT = re.compile(_NOT_IN_SUBJECT_CLASS)


def stream_name(prefix: str) -> str:
    """The stream of envelopes of ``prefix``: upper-cased, sanitised."""
    return _UNSAFE.sub("_", prefix).upper()


def consumer_name(pattern: str, group: str) -> str:
    """The durable consumer of (pattern, group): readable, deterministic and unique."""
    digest = hashlib.sha256(f"{pattern}\x00{group}".encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', group)[:48]}-{_UNSAFE.sub('_', pattern)[:32]}-{digest}"


def id_token(envelope_id: str) -> str:
    """A subject token for an envelope id (ids that are not one are hashed)."""
    if _SAFE_ID.fullmatch(envelope_id):
        return envelope_id
    return "h" + hashlib.sha256(envelope_id.encode()).hexdigest()[:40]


def check_subject_text(kind: str, text: str) -> None:
    """:class:`ConfigurationError` when ``text`` holds what a subject cannot."""
    if _NOT_IN_SUBJECT.search(text):
        raise ConfigurationError(
            f"{kind} {text!r} cannot be a NATS subject: no whitespace or control characters"
        )


def subject_limits(prefix: str, stream: str) -> TopicLimits:
    """What topics and patterns fit in NATS subjects under ``prefix``.

    A topic is published to ``{prefix}.{topic}``; a pattern becomes a consumer's filter
    subject, which nats-py sends in the subject of the request that creates it
    (``$JS.API.CONSUMER.CREATE.{stream}.{name}.{prefix}.{pattern}``). Either must fit
    in the server's protocol line with what surrounds it: a longer one makes the server
    close the connection.
    """
    room = _CONTROL_LINE - _LINE_ROOM - len(prefix.encode()) - 1
    return TopicLimits(
        max_topic_bytes=room,
        max_pattern_bytes=room - len(f"$JS.API.CONSUMER.CREATE.{stream}.".encode()) - _NAME_MAX - 1,
        forbidden=_NOT_IN_SUBJECT_CLASS,
        why=(
            "a NATS subject holds no whitespace or control character and fits, with its "
            f"prefix {prefix!r}, in the server's {_CONTROL_LINE}-byte protocol line"
        ),
    )
