"""Rate limits: at most ``rate`` envelopes per ``per`` seconds, the others deferred."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable
from typing import Any

import anyio

from .._checks import check_seconds
from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from .._handling import current_handling
from .._rates import RateStore, next_turn
from .._types import Handler
from .._verdicts import Defer

__all__ = ["RateLimit"]

logger = logging.getLogger("asyncbus.rate_limit")

#: Keys kept before idle ones (whose bucket is full again) are forgotten.
_MAX_KEYS = 10_000


class RateLimit:
    """Middleware: handle at most ``rate`` envelopes per ``per`` seconds (per ``key``),
    deferring the others, never failing them.

    A token bucket of ``burst`` tokens (default: ``rate`` rounded up, at least 1)
    refilled at ``rate`` per ``per`` seconds, on the event loop's clock. An envelope
    that finds no token is given the next free turn and returned :class:`Defer` until
    then: it comes back when its turn is due and runs without asking again, so each
    envelope is deferred at most once, turns are handed out in arrival order, and the
    limit is never exceeded. Deferring is not a failure: ``Retry``'s budget and
    ``max_deliveries`` are untouched, and the stage's ``deferred`` counts it.

    Each subscription has its own buckets. Over a broker that keeps rate limits (Redis,
    NATS, PostgreSQL: ``transport.rate_store()``) the turns are taken there, so every replica of the
    group draws from the same buckets (the key's ``str()`` names a bucket) and the limit
    holds for the group as a whole; if the broker cannot be asked, this process limits
    on its own meanwhile (a warning says so). Elsewhere (in memory, RabbitMQ) the limit
    is this process's: each replica limits what it handles.

    :param rate: envelopes per ``per`` seconds, a finite number ``> 0``.
    :param per: the period in seconds.
    :param burst: envelopes that may run back to back after a quiet spell.
    :param key: a callable of the envelope giving the bucket (per customer, say);
        ``None``: one bucket for the subscription.
    :raises ConfigurationError: for a rate, period or burst that cannot work.
    """

    def __init__(
        self,
        rate: float,
        per: float = 1.0,
        burst: int | None = None,
        key: Callable[[Envelope], Hashable] | None = None,
    ) -> None:
        self.rate = check_seconds(rate, "RateLimit: rate")
        self.per = check_seconds(per, "RateLimit: per")
        if burst is None:
            burst = max(1, math.ceil(self.rate))
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigurationError(f"RateLimit: burst must be an int >= 1, got {burst!r}")
        if key is not None and not callable(key):
            raise ConfigurationError(f"RateLimit: key must be a callable or None, got {key!r}")
        self.burst = burst
        self.key = key
        #: Seconds between two turns.
        self.interval = self.per / self.rate
        #: Bucket -> when its bucket would be empty again with no more arrivals (the
        #: theoretical arrival time of the next turn), on the loop's clock.
        self._next: dict[Hashable, float] = {}
        #: Envelope id -> the turn it was given when deferred.
        self._turns: dict[str, float] = {}
        #: Whether the broker's turns could not be taken last time (warned once).
        self._unshared = False

    def __repr__(self) -> str:
        return f"RateLimit(rate={self.rate!r}, per={self.per!r}, burst={self.burst!r})"

    def wait(self, bucket: Hashable, now: float) -> float:
        """Take the next turn of ``bucket`` at ``now``: seconds until it is due (0: now)."""
        wait, self._next[bucket] = next_turn(self._next.get(bucket), now, self.interval, self.burst)
        if len(self._next) > _MAX_KEYS:
            self._forget(now)
        return wait

    def _forget(self, now: float) -> None:
        """Drop the buckets that are full again (nothing owed): they start afresh."""
        horizon = now - (self.burst - 1) * self.interval
        self._next = {bucket: due for bucket, due in self._next.items() if due > horizon}

    async def _take(
        self, stage: str, bucket: Hashable, now: float, shared: RateStore | None
    ) -> float:
        """The wait of the next turn of ``bucket`` of ``stage``: the broker's when it
        keeps them, else (or when it does not answer) this process's."""
        if shared is not None:
            name = stage if bucket is None else f"{stage}/{bucket}"
            try:
                wait = await shared.take(name, self.interval, self.burst)
            except TransportError as error:
                if not self._unshared:
                    logger.warning(
                        "RateLimit of %s: the broker's turns cannot be taken, this process "
                        "limits on its own meanwhile: %s",
                        stage,
                        error,
                    )
                self._unshared = True
            else:
                if self._unshared:
                    logger.warning("RateLimit of %s: the broker's turns are taken again", stage)
                self._unshared = False
                return wait
        return self.wait((stage, bucket), now)

    def __call__(self, call_next: Handler) -> Handler:
        # The broker's store, found at the chain's first envelope (the bus is known then).
        chosen: list[RateStore | None] = []

        async def handle(envelope: Envelope) -> Any:
            now = anyio.current_time()
            turns = self._turns
            if turns.pop(envelope.id, None) is None:  # (back for its turn: it runs)
                handling = current_handling()
                if not chosen:
                    chosen.append(handling.host.rate_store() if handling is not None else None)
                stage = handling.stage.name if handling is not None else ""
                bucket = None if self.key is None else self.key(envelope)
                wait = await self._take(stage, bucket, now, chosen[0])
                if wait > 0:
                    if len(turns) >= _MAX_KEYS * 10:
                        # Turns of envelopes that never came back (expired, abandoned).
                        stale = now - 60 * self.per
                        self._turns = turns = {i: t for i, t in turns.items() if t > stale}
                    turns[envelope.id] = now + wait
                    return Defer(wait)
            return await call_next(envelope)

        return handle
