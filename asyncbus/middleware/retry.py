"""Retry with exponential backoff, without holding a consumer while it waits."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from .._checks import check_count, check_number, check_seconds
from .._envelope import Envelope
from .._exceptions import ConfigurationError, DecodeError, Reject
from .._failures import handler_failure
from .._types import Handler
from .._verdicts import RetryAfter

__all__ = ["Retry"]


@dataclass(frozen=True, slots=True)
class Retry:
    """Retry policy for a stage, and the middleware that applies it.

    The delay before attempt ``n + 1`` is ``min(backoff * multiplier**(n-1),
    max_backoff)``, jittered (between half and all of it) when ``jitter``. While it
    waits the envelope sits on a timer, not in a consumer, and then re-enters its own
    stage only. ``Reject`` and exceptions outside ``retry_on`` are never retried.

    :raises ConfigurationError: for ``max_attempts < 1``, a negative, NaN or infinite
        backoff or max_backoff, a multiplier below 1 (or NaN, or infinite), or a
        ``retry_on`` that is not exception classes.
    """

    max_attempts: int = 3
    backoff: float = 0.1
    multiplier: float = 2.0
    max_backoff: float = 30.0
    jitter: bool = True
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        check_count(self.max_attempts, "Retry: max_attempts", 1)
        for name in ("backoff", "max_backoff"):
            object.__setattr__(
                self, name, check_seconds(getattr(self, name), f"Retry: {name}", zero=True)
            )
        multiplier = check_number(self.multiplier, "Retry: multiplier", above=1, inclusive=True)
        object.__setattr__(self, "multiplier", multiplier)
        if not isinstance(self.jitter, bool):
            raise ConfigurationError(f"Retry: jitter must be a bool, got {self.jitter!r}")
        retry_on = self.retry_on
        if isinstance(retry_on, type):
            retry_on = (retry_on,)
        elif isinstance(retry_on, list):
            retry_on = tuple(retry_on)
        if (
            not isinstance(retry_on, tuple)
            or not retry_on
            or not all(
                isinstance(kind, type) and issubclass(kind, BaseException) for kind in retry_on
            )
        ):
            raise ConfigurationError(
                "Retry: retry_on must be an exception class or a non-empty tuple of them, "
                f"got {self.retry_on!r}"
            )
        object.__setattr__(self, "retry_on", retry_on)

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` before the next one.

        ``min(backoff * multiplier**(attempt-1), max_backoff)``, computed so that no
        attempt count or multiplier overflows: past ``max_backoff`` it is ``max_backoff``.
        """
        base = self._capped(max(attempt, 1) - 1)
        if self.jitter:
            return base * (0.5 + random.random() / 2)  # jitter, not cryptography
        return base

    def _capped(self, exponent: int) -> float:
        backoff, multiplier, cap = self.backoff, self.multiplier, self.max_backoff
        if backoff == 0 or cap == 0:
            return 0.0
        if backoff >= cap:
            return cap
        if exponent == 0 or multiplier == 1:
            return backoff
        # backoff * multiplier**exponent >= cap  <=>  exponent >= log(cap/backoff)/log(m):
        # decided on logarithms, so a huge exponent never builds a huge number.
        if exponent >= (math.log(cap) - math.log(backoff)) / math.log(multiplier):
            return cap
        return min(backoff * multiplier**exponent, cap)

    @property
    def asyncbus_builtin(self) -> str:
        """Marks this as the built-in ``retry`` layer (a listed one replaces the default)."""
        return "retry"

    def _retry_after(self, error: BaseException, attempt: int) -> RetryAfter | None:
        """This layer's decision on ``error`` raised by attempt ``attempt``: the
        :class:`RetryAfter` it returns, or ``None`` when it lets the failure through
        (``Reject`` and undecodable payloads never retry; the bus's own cancellation is
        no failure). The one rule, for a call and for a batch's envelopes alike."""
        if (
            isinstance(error, Reject | DecodeError)
            or not isinstance(error, self.retry_on)
            or attempt >= self.max_attempts
            or handler_failure(error) is None
        ):
            return None
        return RetryAfter(self.delay(attempt), error)

    def __call__(self, call_next: Handler) -> Handler:
        """Wrap ``call_next``: a retryable failure returns :class:`RetryAfter` the delay."""
        retry_on = self.retry_on
        retry_after = self._retry_after

        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except (Reject, DecodeError):
                raise
            except retry_on as error:
                verdict = retry_after(error, envelope.attempt)
                if verdict is None:
                    raise
                return verdict

        return handle
