"""What the bus calls for time: scheduled publishes, their cancelling, periodic schedules.

:class:`Timekeeping` holds the bus's clock (:class:`~.due.BusTime`), the keeper its mode
chose (this process in memory, the broker otherwise) and its periodic schedules, and
runs both in one task of the bus while it runs.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from anyio.abc import TaskGroup

from .._dedup import DedupStore
from .._envelope import Envelope, Receipt, make_envelope
from .._options import PublishOptions
from .due import BusTime, as_datetime, check_due, guarded
from .held import Fire, Keeper, ScheduledEnvelope
from .periodic import HEADER_TICK, Schedule, Schedules, tick_id

if TYPE_CHECKING:
    from .._publishing import Publisher

__all__ = ["Timekeeping"]

logger = logging.getLogger("asyncbus.schedule")


class Timekeeping:
    """A bus's scheduled envelopes and periodic schedules (one per bus)."""

    def __init__(
        self,
        publisher: Publisher,
        keeper_of: Callable[[BusTime, Fire], Keeper],
        claim_store: Callable[[], tuple[DedupStore, bool]],
    ) -> None:
        self.clock = BusTime()
        self._publisher = publisher
        self.keeper = keeper_of(self.clock, self._fire)
        self._claim_store = claim_store
        self.schedules = Schedules(self.clock, self._publish_tick)

    def start(self, tasks: TaskGroup, running: Callable[[], bool]) -> None:
        """Fire scheduled envelopes and periodic ticks in ``tasks`` (the bus's) until
        they are cancelled (the bus's stop), while ``running()``."""
        self.clock.start()
        store, shared = self._claim_store()
        system = self._publisher.system
        self.schedules.unshared = None if shared or system == "memory" else system
        tasks.start_soon(guarded, self.keeper.run, running, name="asyncbus scheduled envelopes")
        tasks.start_soon(
            guarded, self.schedules.run, running, shared, store, name="asyncbus schedules"
        )

    # -- scheduled publishes ----------------------------------------------------

    def due(self, delay: Any, at: Any, where: str) -> float | None:
        """The instant a publish given ``delay``/``at`` is due (``None``: now)."""
        return check_due(delay, at, self.clock.now(), where)

    async def publish(
        self, topic: str, payload: Any, options: PublishOptions, due: float
    ) -> Receipt:
        """Keep one envelope until ``due``: ``Bus.publish(delay=/at=)``."""
        envelope = self._publisher.build_one(topic, payload, options)
        await self.keeper.hold([envelope], due)
        return _receipt(envelope, due)

    async def publish_many(
        self, topic: str, payloads: Iterable[Any], options: PublishOptions, due: float
    ) -> list[Receipt]:
        """Keep one envelope per payload until ``due``: ``Bus.publish_many(delay=/at=)``."""
        envelopes = self._publisher.build_many(topic, payloads, options)
        if envelopes:
            await self.keeper.hold(envelopes, due)
        return [_receipt(envelope, due) for envelope in envelopes]

    def hold_request(self, due: float) -> Callable[[Envelope], Awaitable[Receipt]]:
        """How a request due later is sent: kept until ``due``."""

        async def hold(envelope: Envelope) -> Receipt:
            await self.keeper.hold([envelope], due)
            return _receipt(envelope, due)

        return hold

    async def cancel(self, envelope_id: str) -> bool:
        """``Bus.cancel_scheduled``: whether it was still pending (now never published)."""
        if not isinstance(envelope_id, str):
            return False
        return await self.keeper.cancel(envelope_id)

    def listed(self) -> list[ScheduledEnvelope]:
        """``Bus.scheduled()``."""
        return self.keeper.listed()

    async def _fire(self, envelope: Envelope) -> Receipt:
        """Publish a scheduled envelope that came due, as a publish now would be: a
        fresh timestamp (its ``ttl`` counts from now), attempt 1, the same id."""
        due = make_envelope(
            envelope.id,
            envelope.topic,
            envelope.payload,
            envelope.headers,
            time.time(),
            envelope.ttl,
            1,
            envelope.slip,
            envelope.correlation_id,
            envelope.causation_id,
            envelope.reply_to,
            envelope.sender,
        )
        return await self._publisher.send("publish", due, None)

    # -- periodic schedules -----------------------------------------------------

    def add(self, schedule: Schedule) -> Schedule:
        """Run ``schedule`` with the bus (from now on, if it runs)."""
        self.schedules.add(schedule)
        return schedule

    async def _publish_tick(self, schedule: Schedule, tick: float) -> None:
        """Publish ``schedule``'s envelope for ``tick`` (its id is the tick's)."""
        headers = dict(schedule.headers)
        zone = getattr(schedule.ticks, "zone", dt.UTC)
        headers[HEADER_TICK] = as_datetime(tick).astimezone(zone).isoformat()
        options = PublishOptions(headers=MappingProxyType(headers), id=tick_id(schedule, tick))
        envelope = self._publisher.envelope(schedule.topic, schedule.payload, options)
        logger.debug("schedule %r: publishing tick %s", schedule.name, headers[HEADER_TICK])
        await self._publisher.send("publish", envelope, None)


def _receipt(envelope: Envelope, due: float) -> Receipt:
    return Receipt(envelope.id, scheduled=as_datetime(due))
