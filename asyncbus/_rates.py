"""Where a rate limit keeps its turns when every process of a group shares it.

``RateLimit`` hands out turns with the generic cell rate algorithm: each bucket has a
theoretical arrival time (TAT), the instant its next turn is due were nothing owed. A
turn taken at ``now`` is due at ``max(TAT, now - (burst - 1) * interval)`` and moves the
TAT one ``interval`` past it, so ``burst`` turns may be due at once after a quiet
spell and turns are handed out in the order they are asked for.

In one process the middleware keeps TATs itself (on the loop's clock). Over a broker
that offers a :class:`RateStore` (``transport.rate_store()``: Redis, NATS, PostgreSQL),
the TATs are kept there and each turn is taken in one atomic step, so every replica
draws from the same bucket.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["RateStore", "next_turn", "next_turns"]


@runtime_checkable
class RateStore(Protocol):
    """Turns of rate limits kept in a broker, shared by every process using it."""

    async def take(self, key: str, interval: float, burst: int) -> float:
        """Take the next turn of bucket ``key`` (``interval`` seconds apart, ``burst``
        of them due at once at most): seconds until it is due, 0 for now.

        :raises TransportError: the broker did not answer.
        """
        ...


def next_turn(tat: float | None, now: float, interval: float, burst: int) -> tuple[float, float]:
    """One turn of a bucket whose TAT is ``tat`` (``None``: a new bucket), at ``now``:
    ``(seconds until the turn is due, the bucket's new TAT)``."""
    turn = _first_turn(tat, now, interval, burst)
    return max(0.0, turn - now), turn + interval


def next_turns(
    tat: float | None, now: float, interval: float, burst: int, count: int
) -> tuple[list[float], float]:
    """``count`` turns in a row of one bucket (as :func:`next_turn` ``count`` times):
    ``(the seconds until each is due, the bucket's new TAT)``."""
    first = _first_turn(tat, now, interval, burst)
    waits = [max(0.0, first + index * interval - now) for index in range(count)]
    return waits, first + count * interval


def _first_turn(tat: float | None, now: float, interval: float, burst: int) -> float:
    """When the next turn of a bucket whose TAT is ``tat`` is due, asked at ``now``."""
    earliest = now - (burst - 1) * interval  # a full bucket's worth of credit
    return earliest if tat is None else max(tat, earliest)
