"""Names and keys of the RabbitMQ transport: queue names, binding keys, retry buckets."""

from __future__ import annotations

import hashlib
import math

from .._exceptions import ConfigurationError
from .._routing import compile_pattern

__all__ = [
    "KEY_LIMIT",
    "NAME_CHARACTERS",
    "binding_key",
    "bounded",
    "delay_bucket_ms",
    "escape",
]

#: AMQP limits names, routing and binding keys to 255 bytes; retry queues add a suffix.
_NAME_LIMIT = 200
KEY_LIMIT = 255


#: What AMQP clients accept in queue and exchange names (pamqp checks it).
NAME_CHARACTERS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:#,/ "
)


def escape(name: str) -> str:
    """``name`` made fit for an AMQP name, injectively."""
    # Injective: every byte outside the safe set, and the escape ``+`` and the
    # separator ``@`` themselves, become ``+XX``.
    if all(character in NAME_CHARACTERS for character in name):
        return name
    return "".join(
        character
        if character in NAME_CHARACTERS
        else "".join(f"+{byte:02X}" for byte in character.encode())
        for character in name
    )


def bounded(name: str) -> str:
    """``name``, or its first bytes and a hash of it when it is too long for AMQP."""
    data = name.encode()
    if len(data) <= _NAME_LIMIT:
        return name
    digest = hashlib.sha256(data).hexdigest()[:16]
    return data[: _NAME_LIMIT - 17].decode(errors="ignore") + "#" + digest


def binding_key(pattern: str) -> str:
    """The AMQP binding key of a NATS-style ``pattern``.

    ``*`` is one word in both; NATS's trailing ``>`` (one or more tokens) becomes
    ``*.#`` (one word, then zero or more).

    :raises ConfigurationError: for an invalid pattern (a ``#`` token, AMQP's
        multi-word wildcard, included: ``compile_pattern`` refuses it), or a key over
        255 bytes.
    """
    compile_pattern(pattern)
    key = ".".join("*.#" if token == ">" else token for token in pattern.split("."))
    if len(key.encode()) > KEY_LIMIT:
        raise ConfigurationError(f"pattern {pattern!r} is longer than AMQP's 255-byte keys")
    return key


def delay_bucket_ms(delay: float) -> int:
    """Milliseconds a retry delayed by ``delay`` seconds waits: rounded up, 16 per doubling."""
    ms = max(1, math.ceil(delay * 1000))
    if ms <= 16:
        return ms
    step = 1 << (ms.bit_length() - 5)
    return -(-ms // step) * step
