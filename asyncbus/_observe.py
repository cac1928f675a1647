"""What the integrations and test helpers read of a bus, and how they hook into it.

The bus keeps these internals private; this module is the one place outside it that
reads them, so the integrations (tracing, metrics, the admin app) and
:func:`asyncbus.testing.capture` depend on nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from anyio.abc import TaskGroup

from ._bus import Bus
from ._envelope import Envelope
from ._instrument import Instrumentation, combine, parts_of
from ._stats import LatencyHistogram
from ._subscription import Subscription

__all__ = [
    "attach",
    "bus_state",
    "dead_letter_counts",
    "detach",
    "observers",
    "on_loop",
    "stage_timings",
    "stages_subscribed",
    "subscriptions",
    "task_group",
]

T = TypeVar("T")


def attach(bus: Bus, instrumentation: Instrumentation) -> None:
    """Make ``bus`` call ``instrumentation`` too (after those already attached).

    Dispatches already running finish with the instrumentations they started with.
    """
    services = bus._services
    services.instrumentation = combine((*parts_of(services.instrumentation), instrumentation))


def detach(bus: Bus, instrumentation: Instrumentation) -> None:
    """Stop ``bus`` calling ``instrumentation`` (nothing if it was not attached)."""
    services = bus._services
    parts = parts_of(services.instrumentation)
    services.instrumentation = combine(tuple(part for part in parts if part is not instrumentation))


def observers(bus: Bus) -> list[Callable[[Envelope], None]]:
    """The functions ``bus`` calls with every envelope it routes (publishes, hops, replays)."""
    return bus._observers


def task_group(bus: Bus) -> TaskGroup:
    """The task group of the running ``bus``; its tasks end with the bus.

    :raises BusClosedError: when the bus is not running.
    """
    return bus._tasks()


def bus_state(bus: Bus) -> str:
    """``new``, ``running``, ``closing`` (aclose began: draining) or ``closed``."""
    return bus._life.state


def stages_subscribed(bus: Bus) -> bool:
    """Whether every stage's broker subscription exists (always, in memory)."""
    return all(
        stage.subscribed is None or stage.subscribed.is_set() for stage in bus._stages.values()
    )


def subscriptions(bus: Bus) -> list[tuple[Subscription, ...]]:
    """The subscriptions of each stage of ``bus``, stages in the order they were made.

    The bus's own reply inbox (made for a request over a broker) is left out: it is
    no subscription of the application's.
    """
    inbox = bus._replies.inbox
    return [tuple(stage.subscriptions) for stage in bus._stages.values() if stage.group != inbox]


def stage_timings(bus: Bus) -> dict[str, tuple[LatencyHistogram, LatencyHistogram]]:
    """Stage name -> (handling latency, queue wait) histograms, read-only."""
    return {stage.name: (stage.latency, stage.wait) for stage in bus._stages.values()}


def dead_letter_counts(bus: Bus) -> dict[tuple[str | None, str], int]:
    """Dead letters in the queue now per (stage, reason), without scanning it."""
    return {(stage, reason.value): n for (stage, reason), n in bus.dead_letters._counts().items()}


def on_loop(bus: Bus, read: Callable[[], T]) -> T:
    """``read()`` on the thread that runs ``bus`` (where its state lives), from any thread.

    A scrape made from another thread (a metrics server thread) waits for the loop to
    run it; on the loop thread, or when the bus is not running, it runs here.
    """
    return bus._life.on_loop(read)
