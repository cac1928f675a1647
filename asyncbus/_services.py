"""The bus's services: the one object its stages, consumers, modes and middleware reach
it through (the hosts they name: ``StageHost``, ``ConsumerHost``, ``ModeHost``...)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import anyio
from anyio.lowlevel import checkpoint

from . import _instrument
from ._logging import FailureLog

if TYPE_CHECKING:
    from ._dead_lettering import DeadLettering
    from ._dead_letters import DeadLetter, DeadLetterReason
    from ._dedup import DedupStore
    from ._draining import Draining, DrainWaiter
    from ._envelope import Envelope
    from ._exceptions import ConfigurationError
    from ._leases import LeaseStore
    from ._life import Life
    from ._modes import Mode
    from ._rates import RateStore
    from ._replies import Replies
    from ._stage import Stage

__all__ = ["Services", "Stopping"]


class Stopping(Protocol):
    """What stops the bus, or withdraws a subscription, for its services."""

    def refused(self, stage: Stage, error: ConfigurationError) -> None:
        """The broker refused ``stage``'s subscription for good; its pump has ended."""

    async def halt(self, error: BaseException) -> NoReturn:
        """A handler raised ``error`` (``KeyboardInterrupt``, ...): stop the bus."""


class Services:
    """What the stages, consumers and middleware of one bus reach it through.

    One per bus; it holds the state the hot paths read (the yield, the
    instrumentation, the ``drain()`` waiters) and forwards the rest to the parts of
    the bus, handed over once they are made (:meth:`connect`).
    """

    __slots__ = (
        "_consumers",
        "_dead_lettering",
        "_draining",
        "_life",
        "_mode",
        "_replies",
        "_stopping",
        "background",
        "failure_log",
        "idle_waiters",
        "instrumentation",
        "publish_yield",
        "yield_now",
    )

    _mode: Mode
    _draining: Draining
    _replies: Replies
    _dead_lettering: DeadLettering
    _stopping: Stopping

    def __init__(self, life: Life) -> None:
        self._life = life
        #: The backend's checkpoint, resolved at start (the bus's one yield per operation).
        self.yield_now: Callable[[], Awaitable[None]] = checkpoint
        #: What ``publish`` and ``publish_many`` await before they admit anything: the
        #: backend's yield in memory; over a broker a cancellation check only, since
        #: waiting for the broker's confirmation is the call's one yield (resolved at
        #: start).
        self.publish_yield: Callable[[], Awaitable[None]] = checkpoint
        # Told where envelopes leave and around each dispatch (tracing, carried
        # contextvars); None costs the hot path one attribute check.
        self.instrumentation: _instrument.Instrumentation | None = None
        #: ``drain()`` calls waiting for the bus to be idle.
        self.idle_waiters: list[DrainWaiter] = []
        #: Background tasks running (``drain()`` waits for them).
        self.background = 0
        #: Writes the log records of envelopes that were not acked (rate-limited).
        self.failure_log = FailureLog()
        self._consumers: dict[str, _instrument.Consumer] = {}

    def connect(
        self,
        mode: Mode,
        draining: Draining,
        replies: Replies,
        dead_lettering: DeadLettering,
        stopping: Stopping,
    ) -> None:
        """Hand over the parts of the bus the services forward to (once, as it is made)."""
        self._mode = mode
        self._draining = draining
        self._replies = replies
        self._dead_lettering = dead_lettering
        self._stopping = stopping

    def dead_letter(
        self,
        envelope: Envelope,
        reason: DeadLetterReason,
        error: str | None,
        stage: str | None,
        attempts: int,
        cause: BaseException | None = None,
        *,
        stored: bool = False,
    ) -> DeadLetter | None:
        """Record ``envelope`` as dead (see :meth:`DeadLettering.record`)."""
        return self._dead_lettering.record(
            envelope, reason, error, stage, attempts, cause, stored=stored
        )

    def settled(self, stage: Stage) -> None:
        """An envelope of ``stage`` reached its end: wake ``drain()`` when it is over."""
        if self.idle_waiters and stage.quiet:
            self._draining.wake()

    def start_soon(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``function(*args)`` in the bus's task group."""
        self._life.tasks().start_soon(function, *args, name=name)

    async def forward(self, envelope: Envelope, result: Any) -> None:
        """Send a handled envelope's result on: its next slip hop, or its requester."""
        await self._replies.forward(envelope, result)

    def start_background(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any
    ) -> None:
        """Run ``function(*args)`` in the bus's task group, counted until it ends
        (``drain()`` waits for it); nothing when the bus is not running.

        From another thread (dead letters purged there), it is started on the loop.
        """
        life = self._life
        task_group = life.task_group
        if task_group is None:
            return
        if threading.get_ident() != life.loop_thread:
            portal = life.portal
            with contextlib.suppress(RuntimeError):  # the portal stopped: the bus did
                if portal is not None:
                    portal.start_task_soon(self.start_background, function, *args)
            return
        self.background += 1
        task_group.start_soon(self._run_background, function, args)

    async def _run_background(
        self, function: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...]
    ) -> None:
        try:
            await function(*args)
        finally:
            self.background -= 1
            if self.idle_waiters:
                self._draining.wake()

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, ``None`` in memory or without one."""
        return self._mode.dedup_store(window)

    def rate_store(self) -> RateStore | None:
        """The broker's shared rate-limit turns, ``None`` in memory or without them."""
        return self._mode.rate_store()

    def lease_store(self) -> LeaseStore | None:
        """The broker's shared ``max_in_flight`` slots, ``None`` in memory or without them."""
        return self._mode.lease_store()

    def consumer_info(self, stage: Stage) -> _instrument.Consumer:
        """How ``stage`` is described to the instrumentation (the same for its life)."""
        consumer = self._consumers.get(stage.name)
        if consumer is None:
            consumer = self._consumers[stage.name] = _instrument.Consumer(
                stage.name,
                stage.pattern,
                stage.group,
                self._mode.system,
                stage.group == self._replies.inbox,
            )
        return consumer

    def forget(self, stage: Stage) -> None:
        """``stage`` was withdrawn: forget how it was described."""
        self._consumers.pop(stage.name, None)

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope for settling with the broker, bounded by the close deadline."""
        return self._mode.cleanup_scope()

    def refused(self, stage: Stage, error: ConfigurationError) -> None:
        """The broker refused ``stage``'s subscription for good (see :class:`Stopping`)."""
        self._stopping.refused(stage, error)

    async def halt(self, error: BaseException) -> NoReturn:
        """A handler raised ``error`` (``KeyboardInterrupt``, ...): stop the bus."""
        await self._stopping.halt(error)
