"""The envelope a consumer task is handling now, for the code it runs.

Each consumer task owns one :class:`Handling`, set once in a context variable and
updated per envelope. Code running in the handler's task reads it: a publish made
there continues the conversation of the envelope in hand, ``drain`` does not wait
for the handler that awaits it, and the ``routing_slip`` and ``deduplicate``
built-ins reach the bus's services (forwarding, the broker's dedup store, the task
group) through :attr:`Handling.host`. Settling is no business of this module: a
middleware returns a verdict (see ``_verdicts``) and the consumer carries it out.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from typing import Any, Protocol

from ._dedup import DedupStore
from ._envelope import Envelope
from ._leases import LeaseStore
from ._rates import RateStore

__all__ = ["Handling", "HandlingHost", "StageView", "current_handling", "handled_envelope"]


class StageView(Protocol):
    """What a handling knows of its stage."""

    name: str
    #: Consumers of the stage whose handler awaits ``bus.drain()``.
    draining: int


class HandlingHost(Protocol):
    """The services of the bus that runs the consumer (one object per bus)."""

    async def forward(self, envelope: Envelope, result: Any) -> None:
        """Send a handled envelope's result on: its next slip hop, or its requester."""

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, ``None`` in memory or without one."""

    def rate_store(self) -> RateStore | None:
        """The broker's shared rate-limit turns, ``None`` in memory or without them."""

    def lease_store(self) -> LeaseStore | None:
        """The broker's shared ``max_in_flight`` slots, ``None`` in memory or without them."""

    def start_soon(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``function(*args)`` in the bus's task group (ends with the bus)."""


_current: ContextVar[Handling | None] = ContextVar("asyncbus_handling", default=None)


class Handling:
    """One consumer task's view of the envelope it handles now.

    :ivar stage: the stage the consumer belongs to.
    :ivar host: the services of the bus that owns the stage.
    :ivar envelope: the envelope being handled, ``None`` between two.
    :ivar batch: the envelopes of the batch in hand (settled ones are ``None``), in a
        batch consumer and in each of its envelopes' tasks; ``None`` for a per-message
        consumer.
    """

    __slots__ = ("batch", "envelope", "host", "stage")

    def __init__(self, stage: StageView, host: HandlingHost) -> None:
        self.stage = stage
        self.host = host
        self.envelope: Envelope | None = None
        self.batch: list[Envelope | None] | None = None

    def in_hand(self) -> int:
        """How many envelopes the handler running here holds in flight (0 between two):
        a batch's all (its members wait for one another), else the one handled."""
        batch = self.batch
        if batch is not None:
            return len(batch) - batch.count(None)
        return 0 if self.envelope is None else 1

    def activate(self) -> None:
        """Make this the calling task's handling (once, when the consumer starts)."""
        _current.set(self)


def current_handling() -> Handling | None:
    """The handling of the calling consumer task, ``None`` outside one."""
    return _current.get()


def handled_envelope() -> Envelope | None:
    """The envelope the calling consumer is handling now, ``None`` outside a handler."""
    handling = _current.get()
    return handling.envelope if handling is not None else None
