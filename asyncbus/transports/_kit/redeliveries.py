"""``max_deliveries``, as every broker transport counts it: a message that keeps killing
its consumer is dead-lettered on arrival after that many deliveries, and a hand-back
(a copy of a message a closing bus gave back unhandled) carries the count so far."""

from __future__ import annotations

from ..._checks import check_count

__all__ = [
    "DEFAULT_MAX_DELIVERIES",
    "HEADER_DELIVERIES",
    "MAX_DELIVERIES_LIMIT",
    "carried_deliveries",
    "checked_max_deliveries",
    "over_max_deliveries",
]


#: Default number of deliveries of one message, none of them settled, after which the
#: next one is dead-lettered on arrival instead of handled (a message that kills its
#: consumer must not loop for ever).
DEFAULT_MAX_DELIVERIES = 10


#: Largest ``max_deliveries``: more deliveries than that of one message is a loop.
MAX_DELIVERIES_LIMIT = 1_000_000


def checked_max_deliveries(value: int) -> int:
    """``value`` as a delivery cap; :class:`ConfigurationError` unless it is an int from 1
    to :data:`MAX_DELIVERIES_LIMIT`."""
    return check_count(value, "max_deliveries", 1, MAX_DELIVERIES_LIMIT)


#: Header of a message a consumer handed back unhandled (its bus was shutting down) as
#: a copy: the deliveries of the message before the one handed back. The broker counts
#: the copy's deliveries from zero, so a hand-back is no delivery toward
#: ``max_deliveries`` (a service restarted ten times does not dead-letter what it held).
HEADER_DELIVERIES = "asyncbus-deliveries"


def carried_deliveries(value: object) -> int:
    """The deliveries a :data:`HEADER_DELIVERIES` value carries (0 for anything else)."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and value.isdigit() and len(value) <= 9:
        return int(value)
    if type(value) is int and 0 <= value < 10**9:
        return value
    return 0


def over_max_deliveries(deliveries: int, limit: int) -> str | None:
    """Why a message the broker has delivered ``deliveries`` times is not handled again
    (``None`` while it is within ``limit``)."""
    if deliveries <= limit:
        return None
    return (
        f"delivered {deliveries} times without being settled (max_deliveries={limit}): "
        "its consumer may crash on it"
    )
