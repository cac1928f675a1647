"""An envelope as a NATS message: the codec's bytes as body, its fields in headers.

The envelope's fields (everything but the payload) travel as JSON in the
:data:`HEADER_META` header, its id as ``Nats-Msg-Id`` (the stream's duplicate window
drops a second publish of it), and a replay for one group names that group's consumer
in :data:`HEADER_REPLAY_GROUP`. A message over the server's ``max_payload`` is refused
before it is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from .._envelope import HEADER_REPLAYED, Envelope
from .._exceptions import TransportError
from ._codec import Codec, envelope_to_wire
from ._kit.outgoing import foreign_message, wire_of

__all__ = ["HEADER_META", "HEADER_REPLAY_GROUP", "envelope_message", "header_size"]

#: Header holding the envelope's fields (everything but the payload) as JSON.
HEADER_META = "asyncbus-meta"
#: Header naming the one consumer a replayed envelope is for; other groups skip it.
HEADER_REPLAY_GROUP = "asyncbus-replay-group"


def _ascii_json(data: bytes) -> str:
    """The same JSON document with every non-ASCII character escaped."""
    return json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=True)


def header_size(headers: Mapping[str, str]) -> int:
    """Bytes ``headers`` take in a message."""
    # "NATS/1.0\r\n" + "name: value\r\n"... + "\r\n"
    return 12 + sum(len(name) + len(value.encode()) + 4 for name, value in headers.items())


def envelope_message(
    envelope: Envelope, target: str | None, codec: Codec, limit: int
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of ``envelope`` on the wire (for group ``target`` only,
    a replay, when given).

    :raises TransportError: when it is larger than ``limit``, the server's ``max_payload``.
    """
    msg_id = envelope.id
    if target is not None or HEADER_REPLAYED in envelope.headers:
        # A replay reuses the envelope id; it must not be dropped as a duplicate
        # of the original (or of another replay of it).
        msg_id = f"{envelope.id}:{target or ''}:{envelope.timestamp!r}"
    if "\r" in msg_id or "\n" in msg_id:
        msg_id = msg_id.replace("\r", " ").replace("\n", " ")
    wire = wire_of(envelope) if target is None else None
    if wire is not None:  # for clients that know nothing of asyncbus
        body, extra, content_type = foreign_message(envelope, wire, codec)
        headers = {"Nats-Msg-Id": msg_id, **extra, "content-type": content_type}
        _refuse_over(envelope, len(body) + header_size(headers), limit)
        return body, headers
    meta, body = envelope_to_wire(envelope, codec)
    # Header values must be ASCII for every nats-py (up to 2.14 a non-ASCII value
    # loses the whole header block): escape what msgspec wrote as UTF-8.
    headers = {
        "Nats-Msg-Id": msg_id,
        HEADER_META: meta.decode() if meta.isascii() else _ascii_json(meta),
    }
    if target is not None:
        headers[HEADER_REPLAY_GROUP] = target
    # (A UTF-8 character is at most 4 bytes: most messages are surely small enough.)
    if len(body) + 4 * (len(msg_id) + len(headers[HEADER_META])) + 256 > limit:
        _refuse_over(envelope, len(body) + header_size(headers), limit)
    return body, headers


def _refuse_over(envelope: Envelope, size: int, limit: int) -> None:
    """:class:`TransportError` when a message of ``size`` bytes is over ``limit``."""
    if size > limit:
        raise TransportError(
            f"envelope {envelope.id} is {size} bytes on the wire, over the NATS "
            f"server's max_payload of {limit} bytes"
        )
