"""A publish's options as one value: made once where the bus's method is called, read
where the envelope is built and where it waits for room, never passed field by field."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from ._admission import Priority

__all__ = ["PLAIN", "PublishOptions", "make_options", "publish_options"]


class PublishOptions(NamedTuple):
    """What a publish asked for besides its topic and payload, as given (each is checked
    where it is used: the envelope's fields where the envelope is built). A named tuple:
    immutable, and made in a fraction of a frozen dataclass's time (this is per publish).

    :ivar headers: the caller's headers.
    :ivar ttl: seconds after which the envelope expires unhandled.
    :ivar slip: the topics its result is forwarded to.
    :ivar key: the ordering key (the ``asyncbus-key`` header).
    :ivar id: the envelope id the caller chose.
    :ivar timeout: the longest wait for room in ``BLOCK`` stages.
    :ivar priority: the admission class (the ``asyncbus-priority`` header).
    """

    headers: Mapping[str, str] | None = None
    ttl: float | None = None
    slip: Sequence[str] | str = ()
    key: str | None = None
    id: str | None = None
    timeout: float | None = None
    priority: Priority | int | None = None


#: A publish with no options at all: the common case, one value for every such call.
PLAIN = PublishOptions()

#: ``make_options((headers, ttl, slip, key, id, timeout, priority))``: the same value as
#: ``PublishOptions(...)``, built without the named tuple's Python-level constructor (a
#: third of its time; this is per publish).
make_options = functools.partial(tuple.__new__, PublishOptions)


def publish_options(
    headers: Mapping[str, str] | None,
    ttl: float | None,
    slip: Sequence[str] | str,
    key: str | None,
    id: str | None,
    timeout: float | None,
    priority: Priority | int | None,
) -> PublishOptions:
    """The options of one call: :data:`PLAIN` when none was given (empty headers or an
    empty slip are none)."""
    if (
        not headers
        and ttl is None
        and not slip
        and key is None
        and id is None
        and timeout is None
        and priority is None
    ):
        return PLAIN
    options: PublishOptions = make_options((headers, ttl, slip, key, id, timeout, priority))
    return options
