"""Where a bus sends what it publishes: its own stages, or a broker.

A bus picks its mode once, when it is made: :class:`LocalMode` when envelopes wait in
this process's stages (no transport, or a direct one such as ``MemoryTransport``),
:class:`BrokerMode` when a broker holds them between publish and handle. Everything
the bus does differently over a broker is a method of :class:`Mode`: routing a publish,
replaying a dead letter, storing and forgetting dead letters, answering a request made
elsewhere, the backlog ``drain()`` waits for, and the grace kept to close with the
broker. Nothing above this package asks which mode it runs in.

The package holds the contract (:mod:`.mode`), the two modes (:mod:`.local`,
:mod:`.broker`) and :func:`choose_mode`.
"""

from __future__ import annotations

from collections.abc import Callable

from .._envelope import Envelope
from .._exceptions import ConfigurationError
from .._routing import Router
from .._stage import Stage
from ..transports.base import Transport
from .broker import BrokerMode, split_stage_name
from .local import LocalMode
from .mode import INBOX, Mode, ModeHost, Progress

__all__ = [
    "INBOX",
    "BrokerMode",
    "LocalMode",
    "Mode",
    "ModeHost",
    "Progress",
    "choose_mode",
    "split_stage_name",
]


def choose_mode(
    transport: Transport | None,
    router: Router[Stage],
    stages: dict[str, Stage],
    host: ModeHost,
    observers: list[Callable[[Envelope], None]],
    codec: object | None,
    stale_group_after: float | None = None,
) -> Mode:
    """The mode of a bus over ``transport``, chosen once (``codec`` is the broker's;
    ``stale_group_after``, the bus's setting, matters over a broker only)."""
    if transport is not None and not isinstance(transport, Transport):
        raise ConfigurationError(
            f"Bus: transport must be a asyncbus.transports.Transport, got {transport!r}"
        )
    local = LocalMode(router, stages, host, observers)
    if transport is None or transport.direct:
        return local
    return BrokerMode(transport, local, codec, stale_group_after)
