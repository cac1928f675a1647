"""A controlled stage: adaptive consumer counts and sojourn shedding wired into a stage.

A stage is *controlled* when it was subscribed with ``admission=`` or with
``concurrency=Adaptive(...)``. Its envelopes then wait in :class:`Lanes` (priority
classes, either end servable) instead of the plain FIFO buffer, every envelope is
timed with the injected clock, and its consumers run :meth:`StageControl.consume`.
Static stages never come here. The controlled consumer loop itself is in
``_consumer``; this module holds the controllers and the crews they size.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

import anyio

from ._adaptive import Adaptive, ConcurrencyLimit
from ._admission import Admission, SojournShedder
from ._lanes import Lanes
from ._subscription import Subscription
from ._types import Handler

__all__ = ["ControlledStage", "Crew", "StageControl", "default_clock"]


class ControlledStage(Protocol):
    """What the controllers read of their stage."""

    name: str
    capacity: int
    subscriptions: list[Subscription]
    consumer_waiters: deque[anyio.Event]


#: The clock controlled stages read (tests replace it with a fake one).
default_clock: Callable[[], float] = anyio.current_time


class Crew:
    """The consumers of one subscription on a controlled stage."""

    __slots__ = (
        "chain",
        "in_flight",
        "limiter",
        "parked",
        "retiring",
        "running",
        "spawn",
        "subscription",
    )

    def __init__(
        self,
        subscription: Subscription,
        clock: Callable[[], float],
        chain: Handler,
        spawn: Callable[[Crew], None],
    ) -> None:
        self.subscription = subscription
        #: Starts one more consumer of this crew.
        self.spawn = spawn
        concurrency = subscription.concurrency
        self.limiter = (
            ConcurrencyLimit(concurrency, clock) if isinstance(concurrency, Adaptive) else None
        )
        self.chain = chain
        #: Consumer tasks alive, retiring ones included.
        self.running = 0
        #: Consumers asked to stop at their next envelope boundary.
        self.retiring = 0
        self.in_flight = 0
        #: Events of this crew's consumers parked on an empty queue.
        self.parked: list[anyio.Event] = []

    @property
    def target(self) -> int:
        """How many consumers this subscription should run now."""
        if self.limiter is not None:
            return self.limiter.limit
        concurrency = self.subscription.concurrency
        assert isinstance(concurrency, int)
        return concurrency


class StageControl:
    """The controllers of one stage and the consumer loop that obeys them.

    :param stage: the stage controlled.
    :param admission: its shedding configuration, ``None`` for none.
    :param clock: seconds, monotonic; ``anyio.current_time`` by default.
    """

    def __init__(
        self,
        stage: ControlledStage,
        admission: Admission | None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.stage = stage
        self.admission = admission
        self.clock = clock if clock is not None else default_clock
        self.lanes = Lanes(self.clock)
        self.shedder = SojournShedder(admission) if admission is not None else None
        self.lifo = admission is not None and admission.lifo
        self.crews: dict[Subscription, Crew] = {}

    # -- what statistics show ------------------------------------------------------

    @property
    def limit(self) -> int:
        """The consumers the stage should run now, over all its subscriptions."""
        total = 0
        for subscription in self.stage.subscriptions:
            crew = self.crews.get(subscription)
            if crew is not None:
                total += crew.target
            else:
                concurrency = subscription.concurrency
                total += concurrency.min if isinstance(concurrency, Adaptive) else concurrency
        return total

    @property
    def consumers(self) -> int:
        """Consumer tasks alive now (retiring ones included); the limit before start."""
        if not self.crews:
            return self.limit
        return sum(crew.running for crew in self.crews.values())

    @property
    def shedding(self) -> bool:
        """Whether the stage is shedding now."""
        return self.shedder is not None and self.shedder.shedding

    def local_bound(self) -> int:
        """Most envelopes the broker pump keeps queued here: the limit, at most ``capacity``."""
        return max(1, min(self.stage.capacity, self.limit))

    def window(self) -> int:
        """Most deliveries the stage's broker subscription holds: what :meth:`local_bound`
        lets it queue, plus one per consumer it should run (what they hold)."""
        limit = self.limit
        return max(1, min(self.stage.capacity, limit)) + limit

    # -- consumers -------------------------------------------------------------------

    def start(
        self, subscription: Subscription, chain: Handler, spawn: Callable[[Crew], None]
    ) -> Crew:
        """Start the subscription's consumers (its limit's worth) on the running bus.

        :param spawn: starts one consumer of the crew (the controlled consumer loop).
        """
        crew = Crew(subscription, self.clock, chain, spawn)
        self.crews[subscription] = crew
        self.resize(crew)
        return crew

    def resize(self, crew: Crew) -> None:
        """Start or retire consumers until the crew matches its target."""
        alive = crew.running - crew.retiring
        want = crew.target
        if want > alive:
            kept = min(crew.retiring, want - alive)  # take back retirements first
            crew.retiring -= kept
            for _ in range(want - alive - kept):
                crew.running += 1
                crew.spawn(crew)
        elif want < alive:
            crew.retiring += alive - want
            # Parked consumers retire now; busy ones after the envelope they hold.
            waiters = self.stage.consumer_waiters
            for _ in range(min(alive - want, len(crew.parked))):
                event = crew.parked.pop()
                if event in waiters:
                    waiters.remove(event)
                event.set()

    def clear(self) -> list[str]:
        """The bus stopped: empty the lanes and forget the crews; return the queued ids."""
        left: list[str] = []
        while self.lanes:
            left.append(self.lanes.pop_oldest()[1].id)
        self.crews.clear()
        if self.shedder is not None:
            self.shedder.idle()
        return left
