"""The bus's figures: its statistics and its shutdown report, summed over its stages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ._runtime import FREE_THREADED
from ._stats import BusStatistics, ShutdownReport

if TYPE_CHECKING:
    from ._dead_letters import DeadLetterQueue
    from ._stage import Stage
    from ._time.service import Timekeeping

__all__ = ["bus_statistics", "shutdown_report"]


def bus_statistics(
    stages: Mapping[tuple[str, str], Stage],
    dead_letters: DeadLetterQueue,
    time: Timekeeping,
    outbox_pending: Callable[[], int | None],
) -> BusStatistics:
    """Every stage's ledger and the bus-wide totals, now (on the bus's thread);
    ``outbox_pending`` reads what the outbox's relay last counted (no query)."""
    snapshots = tuple(stage.statistics() for stage in stages.values())

    def total(field: str) -> int:
        return sum(getattr(stage, field) for stage in snapshots)

    return BusStatistics(
        stages=snapshots,
        published=total("published"),
        acked=total("acked"),
        failed=total("failed"),
        retried=total("retried"),
        dead_lettered=total("dead_lettered"),
        rejected=total("rejected"),
        dropped=total("dropped"),
        expired=total("expired"),
        abandoned=total("abandoned"),
        depth=total("depth"),
        in_flight=total("in_flight"),
        dead_letter_queue=len(dead_letters),
        free_threaded=FREE_THREADED,
        deferred=total("deferred"),
        scheduled=time.keeper.count,
        schedules=tuple(schedule.statistics() for schedule in time.schedules.by_name.values()),
        outbox_pending=outbox_pending(),
    )


def shutdown_report(
    stages: Mapping[tuple[str, str], Stage],
    *,
    drained: bool,
    abandoned: list[str],
    scheduled: list[str],
) -> ShutdownReport:
    """The report of a stop: the stages' totals and what was left."""
    values = stages.values()
    return ShutdownReport(
        drained=drained,
        published=sum(stage.ledger.published for stage in values),
        completed=sum(stage.ledger.acked for stage in values),
        dead_lettered=sum(stage.ledger.dead_lettered for stage in values),
        abandoned=abandoned,
        scheduled=scheduled,
    )
