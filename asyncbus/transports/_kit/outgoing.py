"""Writing an envelope for clients that know nothing of asyncbus: the publish asked for it
with the :data:`~asyncbus.HEADER_WIRE` header (``"plain"``, ``"cloudevents"`` or
``"cloudevents-structured"``). Each broker puts what this module returns where its
clients look (see the guide's "On the wire"):

* **plain**: the body is the payload alone, as the codec encodes it; the envelope's
  own headers (not the bus's ``asyncbus-*``) are the message's headers;
* **cloudevents** (binary mode): the body is the payload; the event's attributes are
  headers ``ce-{attribute}`` (:func:`~.cloudevents.to_attributes`), the data's content
  type the ``content-type``;
* **cloudevents-structured**: the body is the whole event as JSON, content type
  ``application/cloudevents+json``.

Nothing of the bus's meta is written: a bus reading such a message back reads it as a
plain message or a CloudEvent (:mod:`.plain`).
"""

from __future__ import annotations

from ..._envelope import HEADER_WIRE, Envelope
from .._codec import Codec, encode_payload
from .cloudevents import HEADER, STRUCTURED, to_attributes, to_structured

__all__ = ["Foreign", "foreign_message", "wire_of"]

#: What a foreign message is made of: its body, its headers, its content type.
Foreign = tuple[bytes, dict[str, str], str]


def wire_of(envelope: Envelope) -> str | None:
    """The foreign format ``envelope`` is to be written in (``None``: the bus's own)."""
    headers = envelope.headers
    return headers.get(HEADER_WIRE) if headers else None


def foreign_message(envelope: Envelope, wire: str, codec: Codec) -> Foreign:
    """``(body, headers, content type)`` of ``envelope`` in the foreign format ``wire``.

    :raises EncodeError: when the payload cannot be encoded.
    """
    body = encode_payload(codec, envelope.payload)
    content_type = codec.content_type
    if wire == "plain":
        headers = {
            name: value
            for name, value in envelope.headers.items()
            if not name.startswith("asyncbus-")
        }
        return body, headers, content_type
    if wire == "cloudevents-structured":
        return to_structured(envelope, body, content_type), {}, STRUCTURED
    attributes = to_attributes(envelope, content_type)
    content_type = attributes.pop("datacontenttype")
    return body, {HEADER + name: value for name, value in attributes.items()}, content_type
