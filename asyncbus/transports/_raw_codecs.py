"""Codecs for bodies that are not JSON: text and bytes, as producers that know nothing
of asyncbus often write them (a log line, a CSV row, a protobuf a handler parses itself).
Give one to a transport (or a bus) that carries such messages only; payloads it takes and
gives are ``str`` or ``bytes`` alone."""

from __future__ import annotations

from typing import Any

from .._exceptions import DecodeError, EncodeError

__all__ = ["BytesCodec", "TextCodec"]


class TextCodec:
    """A body is UTF-8 text: the handler gets a ``str``; a publish takes a ``str``.

    :param content_type: what a RabbitMQ message (and a plain or CloudEvents publish)
        says its body is.
    """

    def __init__(self, content_type: str = "text/plain; charset=utf-8") -> None:
        self.content_type = content_type

    def encode(self, value: Any) -> bytes:
        """``value`` as UTF-8.

        :raises EncodeError: for anything but a ``str`` (or a lone surrogate in one).
        """
        if not isinstance(value, str):
            raise EncodeError(f"TextCodec encodes str, not {type(value).__name__}")
        try:
            return value.encode()
        except UnicodeEncodeError as error:
            raise EncodeError(f"TextCodec: the text is not UTF-8 encodable: {error}") from None

    def decode(self, data: bytes) -> str:
        """UTF-8 text.

        :raises DecodeError: when the body is not UTF-8 (it is dead-lettered ``rejected``).
        """
        try:
            return bytes(data).decode()
        except UnicodeDecodeError as error:
            raise DecodeError(f"body is not UTF-8 text: {error}") from None


class BytesCodec:
    """A body is bytes as they are: the handler gets ``bytes``; a publish takes
    ``bytes``, ``bytearray`` or ``memoryview``.

    :param content_type: what a RabbitMQ message (and a plain or CloudEvents publish)
        says its body is.
    """

    def __init__(self, content_type: str = "application/octet-stream") -> None:
        self.content_type = content_type

    def encode(self, value: Any) -> bytes:
        """``value``'s bytes.

        :raises EncodeError: for anything but bytes-like.
        """
        if not isinstance(value, bytes | bytearray | memoryview):
            raise EncodeError(f"BytesCodec encodes bytes, not {type(value).__name__}")
        return bytes(value)

    def decode(self, data: bytes) -> bytes:
        """The body itself."""
        return bytes(data)
