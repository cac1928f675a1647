"""A codec that writes one body back as it came: a delivery's raw bytes kept in the
dead letter of a message that did not decode."""

from __future__ import annotations

from typing import Any

__all__ = ["Verbatim"]


class Verbatim:
    """A codec that always encodes to one body: a delivery's raw body, kept as it came."""

    content_type = "application/octet-stream"

    def __init__(self, body: bytes) -> None:
        self.body = body

    def encode(self, value: Any) -> bytes:
        """The body given, whatever ``value`` is."""
        return self.body

    def decode(self, data: bytes) -> Any:
        """``data`` unchanged."""
        return data
