"""What a broker transport checks in its options, and the size limit it holds envelopes to."""

from __future__ import annotations

from ..._checks import check_count, check_seconds
from ..._envelope import Envelope
from ..._exceptions import ConfigurationError, TransportError

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "MAX_SECONDS",
    "checked_max_message_size",
    "checked_prefetch",
    "checked_seconds",
    "refuse_oversized",
]


#: Default largest envelope a broker transport accepts at publish (meta + body, bytes).
DEFAULT_MAX_MESSAGE_SIZE = 16 * 1024 * 1024


def checked_max_message_size(value: int) -> int:
    """``value`` as a size limit; :class:`ConfigurationError` unless it is an int > 0."""
    if isinstance(value, bool) or not (isinstance(value, int) and value > 0):
        raise ConfigurationError(f"max_message_size must be an int > 0, got {value!r}")
    return value


#: Longest timeout or interval a broker transport takes (about 31 years): brokers keep
#: some of them as 64-bit nanoseconds, so a longer one would fail there, not here.
MAX_SECONDS = 1e9


def checked_seconds(value: float, name: str, *, zero: bool = False) -> float:
    """``value`` as a transport's timeout or interval: a finite number of seconds ``> 0``
    (``>= 0`` when ``zero``) up to :data:`MAX_SECONDS`.

    :raises ConfigurationError: for NaN, an infinity, a bool, a huge number, a string.
    """
    return check_seconds(value, name, zero=zero, maximum=MAX_SECONDS)


def checked_prefetch(value: int) -> int:
    """``subscribe``'s ``prefetch``: an int ``>= 1`` (bools refused)."""
    return check_count(value, "prefetch", 1)


def refuse_oversized(envelope: Envelope, size: int, limit: int) -> None:
    """Refuse, before anything is sent, an envelope of ``size`` bytes over ``limit``.

    :raises TransportError: naming the envelope, its size and the limit.
    """
    if size > limit:
        raise TransportError(
            f"envelope {envelope.id} on {envelope.topic!r} is {size} bytes on the wire, "
            f"over max_message_size={limit}: nothing was published"
        )
