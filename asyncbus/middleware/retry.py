"""Retry with exponential backoff, without holding a consumer while it waits."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .._dispatch import current_dispatch
from .._envelope import Envelope
from .._exceptions import ConfigurationError, DecodeError, Reject
from .._types import Handler

__all__ = ["Retry"]


@dataclass(frozen=True, slots=True)
class Retry:
    """Retry policy for a stage, and the middleware that applies it.

    The delay before attempt ``n + 1`` is ``min(backoff * multiplier**(n-1),
    max_backoff)``, jittered (between half and all of it) when ``jitter``. While it
    waits the envelope sits on a timer, not in a consumer, and then re-enters its own
    stage only. ``Reject`` and exceptions outside ``retry_on`` are never retried.

    :raises ConfigurationError: for ``max_attempts < 1``, a negative backoff,
        ``multiplier < 1`` or an empty ``retry_on``.
    """

    max_attempts: int = 3
    backoff: float = 0.1
    multiplier: float = 2.0
    max_backoff: float = 30.0
    jitter: bool = True
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise ConfigurationError(f"Retry: max_attempts must be >= 1, got {self.max_attempts!r}")
        if self.backoff < 0 or self.max_backoff < 0:
            raise ConfigurationError(
                f"Retry: backoff and max_backoff must be >= 0, got {self.backoff!r}, "
                f"{self.max_backoff!r}"
            )
        if self.multiplier < 1:
            raise ConfigurationError(f"Retry: multiplier must be >= 1, got {self.multiplier!r}")
        retry_on = self.retry_on
        if isinstance(retry_on, type):
            object.__setattr__(self, "retry_on", (retry_on,))
        elif not retry_on:
            raise ConfigurationError("Retry: retry_on must name at least one exception type")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` before the next one."""
        base = min(self.backoff * self.multiplier ** (attempt - 1), self.max_backoff)
        if self.jitter:
            return base * (0.5 + random.random() / 2)  # jitter, not cryptography
        return base

    @property
    def asyncbus_builtin(self) -> str:
        """Marks this as the built-in ``retry`` layer (a listed one replaces the default)."""
        return "retry"

    def __call__(self, call_next: Handler) -> Handler:
        """Wrap ``call_next``: a retryable failure schedules the next attempt and returns."""
        max_attempts = self.max_attempts
        retry_on = self.retry_on
        delay = self.delay

        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except (Reject, DecodeError):
                raise
            except retry_on as error:
                dispatch = current_dispatch()
                if dispatch is None or envelope.attempt >= max_attempts:
                    raise
                dispatch.retry(delay(envelope.attempt), error)
                return None

        return handle
