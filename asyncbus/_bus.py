"""The bus: subscriptions become stages, publishes are routed to them, shutdown is accounted."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from contextvars import ContextVar
from datetime import datetime, timedelta, tzinfo
from types import TracebackType
from typing import Any, Literal, NoReturn, TypeVar, overload

import anyio
import anyio.abc
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint

from . import _instrument
from ._adaptive import Adaptive
from ._admission import Admission, Priority
from ._batch import Batch
from ._batching import start_consumers
from ._carry import ContextVarCarrier, checked_contextvars
from ._chain import adapt_handler, build_chain
from ._checks import check_count, check_headers, check_seconds, check_wait
from ._clock import Clock, loop_clock
from ._cluster import ClusterStatistics, ClusterWatch, check_heartbeat
from ._dead_lettering import DeadLettering
from ._dead_letters import DEADLETTER_TOPIC, DeadLetter, DeadLetterReason
from ._dedup import DedupStore
from ._envelope import (
    Envelope,
    Receipt,
)
from ._exceptions import (
    BusClosedError,
    ConfigurationError,
    TransportError,
    not_started,
)
from ._failures import describe_error, loop_closing, stray_cancellation
from ._flights import FlightLimit
from ._groups import GroupListing
from ._handling import current_handling
from ._leases import LeaseStore
from ._life import Life, State
from ._logging import FailureLog
from ._modes import Mode, choose_mode
from ._modes.stale_groups import check_stale_after
from ._offload import (
    WorkerPool,
    hold_switch_interval,
    release_switch_interval,
    thread_pool_reason,
)
from ._options import PLAIN, PublishOptions, make_options, publish_options
from ._ordering import KeyFailure, Ordering
from ._publishing import Publisher
from ._rates import RateStore
from ._replies import Replies
from ._routing import Router, validate_topic
from ._runtime import FREE_THREADED, current_backend, fast_checkpoint
from ._stage import Backpressure, Stage
from ._stats import BusStatistics, ShutdownReport
from ._subscription import Subscription, check_middleware, check_options, make_subscription
from ._time.held import ScheduledEnvelope
from ._time.periodic import CatchUp, Schedule, make_schedule, periodic_topic, tick_handler
from ._time.service import Timekeeping
from ._transactional import Transactional
from ._types import Handler, Middleware
from .middleware.retry import Retry
from .transports.base import Transport

__all__ = ["DEADLETTER_TOPIC", "Bus"]

logger = logging.getLogger("asyncbus.bus")

_now = time.time

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


class _DrainWaiter:
    """One ``drain()`` waiting; ``strict`` unless it runs in a handler of the bus."""

    __slots__ = ("event", "strict")

    def __init__(self, strict: bool) -> None:
        self.event = anyio.Event()
        self.strict = strict


class _Services:
    """What the stages, consumers and middleware of one bus reach it through.

    One per bus; it holds the state the hot paths read (the yield, the
    instrumentation, the ``drain()`` waiters) and forwards the rest to the bus.
    """

    __slots__ = (
        "_bus",
        "_consumers",
        "failure_log",
        "idle_waiters",
        "instrumentation",
        "publish_yield",
        "yield_now",
    )

    def __init__(self, bus: Bus) -> None:
        self._bus = bus
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
        self.idle_waiters: list[_DrainWaiter] = []
        #: Writes the log records of envelopes that were not acked (rate-limited).
        self.failure_log = FailureLog()
        self._consumers: dict[str, _instrument.Consumer] = {}

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
        return self._bus._dead_lettering.record(
            envelope, reason, error, stage, attempts, cause, stored=stored
        )

    def settled(self, stage: Stage) -> None:
        """An envelope of ``stage`` reached its end: wake ``drain()`` when it is over."""
        if self.idle_waiters and stage.quiet:
            self._bus._wake_drainers()

    def start_soon(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any, name: str | None = None
    ) -> None:
        """Run ``function(*args)`` in the bus's task group."""
        self._bus._tasks().start_soon(function, *args, name=name)

    async def forward(self, envelope: Envelope, result: Any) -> None:
        """Send a handled envelope's result on: its next slip hop, or its requester."""
        await self._bus._replies.forward(envelope, result)

    def start_background(
        self, function: Callable[..., Coroutine[Any, Any, Any]], *args: Any
    ) -> None:
        """Run ``function(*args)`` in the bus's task group, counted until it ends
        (``drain()`` waits for it); nothing when the bus is not running.

        From another thread (dead letters purged there), it is started on the loop.
        """
        bus = self._bus
        task_group = bus._life.task_group
        if task_group is None:
            return
        if threading.get_ident() != bus._life.loop_thread:
            portal = bus._life.portal
            with contextlib.suppress(RuntimeError):  # the portal stopped: the bus did
                if portal is not None:
                    portal.start_task_soon(self.start_background, function, *args)
            return
        bus._background += 1
        task_group.start_soon(self._background, function, args)

    async def _background(
        self, function: Callable[..., Coroutine[Any, Any, Any]], args: tuple[Any, ...]
    ) -> None:
        try:
            await function(*args)
        finally:
            self._bus._background -= 1
            if self.idle_waiters:
                self._bus._wake_drainers()

    def dedup_store(self, window: float) -> DedupStore | None:
        """The broker's shared dedup store, ``None`` in memory or without one."""
        return self._bus._mode.dedup_store(window)

    def rate_store(self) -> RateStore | None:
        """The broker's shared rate-limit turns, ``None`` in memory or without them."""
        return self._bus._mode.rate_store()

    def lease_store(self) -> LeaseStore | None:
        """The broker's shared ``max_in_flight`` slots, ``None`` in memory or without them."""
        return self._bus._mode.lease_store()

    def consumer_info(self, stage: Stage) -> _instrument.Consumer:
        """How ``stage`` is described to the instrumentation (the same for its life)."""
        consumer = self._consumers.get(stage.name)
        if consumer is None:
            bus = self._bus
            consumer = self._consumers[stage.name] = _instrument.Consumer(
                stage.name,
                stage.pattern,
                stage.group,
                bus._system,
                stage.group == bus._replies.inbox,
            )
        return consumer

    def cleanup_scope(self) -> contextlib.AbstractContextManager[anyio.CancelScope]:
        """A shielded scope for settling with the broker, bounded by the close deadline."""
        return self._bus._mode.cleanup_scope()

    def refused(self, stage: Stage, error: ConfigurationError) -> None:
        """The broker refused ``stage``'s subscription for good (``Bus._refused``)."""
        self._bus._refused(stage, error)

    async def halt(self, error: BaseException) -> NoReturn:
        """A handler raised ``error`` (``KeyboardInterrupt``, ...): stop the bus (``Bus._halt``)."""
        await self._bus._halt(error)


class Bus:
    """An in-process message bus of SEDA stages; ``async with bus:`` runs it.

    :param transport: where envelopes wait between publish and handle; ``None`` (the
        default) keeps them in each stage's anyio memory stream.
    :param middleware: bus-wide middleware, wrapped around every subscription's own.
    :param workers: size of the worker pool shared by offloaded sync handlers
        (default: the CPU count).
    :param dead_letter_ttl: seconds a dead letter is kept.
    :param dead_letter_maxlen: most dead letters kept; the oldest is evicted past it.
    :param codec: serialisation for transports that need it (unused in memory).
    :param name: name of this bus, used as the ``sender`` of what it publishes.
    :param propagate_contextvars: context variables whose values a publish carries to
        the handlers of what it published (set in the handler's context while it
        handles the envelope), in memory only: over a broker nothing is carried.
    :param stale_group_after: over a broker whose transport lists its groups, warn
        (on the ``asyncbus.groups`` logger, once per group per that many seconds) when
        a publish reaches a group of other processes that has had no consumer for that
        many seconds: a group left behind by a renamed or retired handler. ``None``
        turns the watch off.
    :param heartbeat: over a broker that keeps heartbeats (Redis, NATS), seconds
        between two heartbeats of this process (its identity and statistics, written
        through the broker) that make :meth:`cluster_statistics` the whole deployment's
        view; at most 60. ``None`` turns them off.
    :param outbox: where ``publish(..., connection=)`` writes, inside the caller's
        database transaction, whatever the transport (``PostgresOutbox(dsn)``): the bus
        opens it when it starts and runs its relay, which forwards each committed
        envelope through the transport at least once, in order. ``None``: only a
        transport that writes in transactions itself (``PostgresTransport``) takes
        ``connection=``. One outbox per bus.
    :raises ConfigurationError: for a value that cannot work (NaN or an infinite TTL,
        a negative size, middleware that is not a sequence of callables, ...).
    """

    def __init__(
        self,
        transport: Transport | None = None,
        *,
        middleware: Sequence[Middleware] = (),
        workers: int | None = None,
        dead_letter_ttl: float = 7 * 24 * 3600,
        dead_letter_maxlen: int = 100_000,
        codec: object | None = None,
        name: str = "asyncbus",
        propagate_contextvars: Sequence[ContextVar[Any]] = (),
        switch_interval: float | None = None,
        worker_niceness: int | None = None,
        stale_group_after: float | None = 3600.0,
        heartbeat: float | None = 5.0,
        outbox: object | None = None,
    ) -> None:
        workers = check_count(
            workers if workers is not None else (os.cpu_count() or 1), "Bus: workers", 1
        )
        ttl = check_seconds(dead_letter_ttl, "Bus: dead_letter_ttl")
        maxlen = check_count(dead_letter_maxlen, "Bus: dead_letter_maxlen", 0)
        layers = check_middleware(middleware, "Bus")
        if not isinstance(name, str):
            raise ConfigurationError(f"Bus: name must be a string, got {name!r}")
        carried = checked_contextvars(propagate_contextvars)
        if switch_interval is not None:
            switch_interval = check_seconds(switch_interval, "Bus: switch_interval")
        if worker_niceness is not None:
            worker_niceness = check_count(worker_niceness, "Bus: worker_niceness", 1)
        heartbeat = check_heartbeat(heartbeat)
        self._switch_interval = switch_interval
        self._worker_niceness = worker_niceness
        self.name = name
        self._codec = codec
        #: Where envelopes wait; ``None`` or a :class:`MemoryTransport` keeps them in
        #: the stages' own streams.
        self.transport = transport
        self.workers = workers
        self._middleware = layers
        self._services = _Services(self)
        self._router: Router[Stage] = Router()
        self._routes = self._router.cache  # topic -> stages, read directly on the hot path
        self._stages: dict[tuple[str, str], Stage] = {}
        self._stages_by_name: dict[str, Stage] = {}
        #: Called with every envelope routed (publishes, slip hops, replays); for test
        #: helpers such as :func:`asyncbus.testing.capture`.
        self._observers: list[Callable[[Envelope], None]] = []
        #: In memory or over a broker: chosen here, once.
        self._mode: Mode = choose_mode(
            transport,
            self._router,
            self._stages_by_name,
            self._services,
            self._observers,
            codec,
            check_stale_after(stale_group_after),
        )
        #: The event loop's clock (see ``_clock.py``), read for every duration the bus
        #: decides on; the running loop's own from start on.
        self._clock: Clock = time.monotonic
        #: Where the bus is in its life, as the publisher reads it.
        self._life = Life()
        self._background = 0
        #: This process's heartbeat and the view of the deployment's (``cluster_statistics``).
        self._cluster = ClusterWatch(
            name,
            self._statistics,
            heartbeat or 5.0,
            self._mode.heartbeats() if heartbeat is not None else None,
            self._mode.cleanup_scope,
        )
        self._pool: WorkerPool | None = None
        self._report: ShutdownReport | None = None
        self._holds_switch_interval = False
        #: Whether this run of the bus said which pool its sync handlers run on.
        self._told_pool = False
        self._host: TaskGroup | None = None
        self._runner: int | None = None
        self._started: anyio.Event | None = None
        self._stop_requested: anyio.Event | None = None
        self._stopped: anyio.Event | None = None
        self._stop_deadline = math.inf
        self._deadline_scope: anyio.CancelScope | None = None
        self._drained = False
        #: What stopped the bus without a stop being asked for (a handler's
        #: KeyboardInterrupt or SystemExit, or its task group ending by itself): raised
        #: from ``async with bus`` / ``aclose`` once the bus has stopped.
        self._fatal: BaseException | None = None
        self._fatal_raised = False
        self._exiting = False
        #: The task that started the bus (``async with``, ``__aenter__``).
        self._entered_by: int | None = None
        #: Set when the event loop was torn down under the running bus (never closed).
        self._left_running = False
        #: Subscriptions the broker refused, not yet raised by ``subscribed()``.
        self._refusals: list[ConfigurationError] = []
        #: The transport's name for what this bus sends (``"memory"`` in its stages).
        self._system = self._mode.system
        self._publisher = Publisher(
            name,
            self._life,
            self._wake_drainers,
            self._mode,
            self._services,
            self._router,
            self._observers,
        )
        self._replies = Replies(
            name,
            self._mode,
            self._services,
            self._publisher.send,
            self._subscribe,
            self._wait_subscribed,
        )
        self._publisher.replies = self._replies
        #: Envelopes published for later and periodic schedules (see ``_time``).
        self._time = Timekeeping(self._publisher, self._mode.time_keeper, self._mode.claim_store)
        #: ``publish(connection=)``: the outbox or the transport that writes it, and the
        #: outbox's relay (see ``_transactional.py``).
        self._transactional = Transactional(self._publisher, outbox, transport, codec)
        self._dead_lettering = DeadLettering(
            name,
            self._mode,
            self._services,
            self._router,
            self._replies,
            lambda: self._life.state,
            ttl,
            maxlen,
            self._clock,
        )
        #: Dead letters of every stage, newest last.
        self.dead_letters = self._dead_lettering.queue
        if carried:
            self._services.instrumentation = ContextVarCarrier(carried)

    # -- life cycle -------------------------------------------------------------

    def _tasks(self) -> TaskGroup:
        """The one task group that owns every task of the running bus."""
        if self._life.task_group is None:
            if self._life.state == "new":
                raise not_started("start tasks")
            raise BusClosedError("the bus is not running: use `async with bus:`")
        return self._life.task_group

    @property
    def running(self) -> bool:
        """Whether the bus accepts publishes from outside its handlers."""
        return self._life.state == "running"

    async def __aenter__(self) -> Bus:
        if self._life.state in ("starting", "running", "closing"):
            raise RuntimeError("this Bus is already running")
        previous = self._life.state
        self._life.state = "starting"
        self._started = anyio.Event()
        try:
            return await self._start_bus(previous)
        finally:
            self._started.set()

    async def _start_bus(self, previous: State) -> Bus:
        pool = WorkerPool(self.workers)
        try:
            # Every middleware factory runs here, before anything starts: one that
            # raises leaves the bus as it was, with no task to clean up.
            chains = [
                (stage, subscription, self._chain(subscription, pool))
                for stage in self._stages.values()
                for subscription in stage.subscriptions
            ]
        except BaseException:  # deliberate: whatever a factory raises, undo the state
            self._life.state = previous
            raise
        self._pool = pool
        self._told_pool = False
        self._life.loop_thread = threading.get_ident()
        self._services.yield_now = fast_checkpoint()
        self._services.publish_yield = self._mode.publish_yield(self._services.yield_now)
        self._clock = loop_clock()
        self.dead_letters.use_clock(self._clock)
        self._stop_requested = anyio.Event()
        self._stopped = anyio.Event()
        self._stop_deadline = math.inf
        self._drained = False
        self._report = None
        self._exiting = False
        self._fatal = None
        self._fatal_raised = False
        self._entered_by = anyio.get_current_task().id
        self._left_running = False
        self._refusals = []
        # The bus's own task group runs inside a runner task, so the task that entered
        # ``async with bus`` is never inside the cancel scope that stops the bus:
        # ``aclose()`` works from any task and inside any cancel scope.
        host = anyio.create_task_group()
        await host.__aenter__()
        try:
            await host.start(self._run, name=f"asyncbus {self.name}")
        except BaseException:
            # Deliberate: the runner failed before it started (a broker that cannot be
            # reached) or the start was cancelled: close the empty host group and
            # raise that error itself, unwrapped.
            await host.__aexit__(None, None, None)
            raise
        self._host = host
        self._life.state = "running"
        try:
            # (The relay starts once the bus accepts publishes: it forwards only then.)
            self._transactional.start(self._tasks(), self._life.is_running)
            built = {id(subscription) for _, subscription, _ in chains}
            for stage, subscription, chain in chains:
                self._start(stage, subscription, chain)
            for stage in list(self._stages.values()):  # subscribed while it started
                for subscription in stage.subscriptions:
                    if id(subscription) not in built:
                        self._start(stage, subscription, self._chain(subscription, pool))
            # Over a broker, a publish made as soon as this returns must find every group.
            await self.subscribed()
        except BaseException:
            # Deliberate: whatever interrupts the start (a cancellation included), no
            # running bus is left behind for an ``async with`` that never began.
            self._request_stop(-math.inf)
            with anyio.CancelScope(shield=True):
                await self._stopped.wait()
            self._host = None
            await host.__aexit__(None, None, None)
            self._raise_fatal()  # (a handler stopped the bus while it started)
            raise
        return self

    async def subscribed(self) -> None:
        """Wait until every stage's broker subscription exists (at once in memory).

        ``async with bus`` waits for this itself; after a ``subscribe`` on a running
        bus over a broker, await it before publishing what the new group must get.

        :raises ConfigurationError: when the broker refused a subscription for good
            (a pattern it cannot take) since the last call: that subscription was
            withdrawn and the rest of the bus runs on as it was.
        """
        await self._wait_subscribed()
        if self._refusals:
            first = self._refusals[0]
            self._refusals.clear()
            raise first

    async def _wait_subscribed(self) -> None:
        """Wait until every stage's broker subscription exists or was refused."""
        for stage in list(self._stages.values()):
            if stage.subscribed is not None:
                await stage.subscribed.wait()

    def _refused(self, stage: Stage, error: ConfigurationError) -> None:
        """The broker refused ``stage``'s subscription for good; its pump has ended.

        On the running bus the stage is withdrawn (made by a ``subscribe`` there): the
        other stages go on, nothing of the bus's state is left of it, and the error
        reaches the next ``subscribed()``. While the bus starts, the start fails with
        it (``subscribed()`` raises it in ``async with bus``).
        """
        self._refusals.append(error)
        if self._started is not None and self._started.is_set():
            logger.error(
                "stage %r: the broker refused its subscription, which is withdrawn "
                "(the rest of the bus goes on): %s",
                stage.name,
                describe_error(error),
            )
            key = (stage.pattern, stage.group)
            if self._stages.get(key) is stage:
                del self._stages[key]
                del self._stages_by_name[stage.name]
                self._router.remove(stage)
            stage.withdraw()
            self._services._consumers.pop(stage.name, None)
        if stage.subscribed is not None:
            stage.subscribed.set()  # (wakes subscribed())
        if self._services.idle_waiters:
            self._wake_drainers()

    async def _run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The runner task: owns the transport, the portal and the bus's task group.

        It also carries out the shutdown: when a stop is requested it drains until the
        deadline (which later requests may bring forward), then cancels the rest, so
        the stop happens whatever becomes of the caller that asked for it.
        """
        self._runner = anyio.get_current_task().id
        asked = True  # (set again when the task group ends: was a stop asked for?)
        try:
            async with AsyncExitStack() as stack:
                await self._mode.open(stack, self.dead_letters)
                await self._transactional.open(stack)
                portal = await stack.enter_async_context(BlockingPortal())
                async with anyio.create_task_group() as task_group:
                    self._life.task_group = task_group
                    self._life.portal = portal
                    for stage in self._stages.values():
                        stage.open()
                    if self._cluster.store is not None:
                        task_group.start_soon(self._cluster.run)
                    self._time.start(task_group, self._life.is_running)
                    task_status.started()
                    try:
                        await self._wait_for_stop_request()
                        with anyio.CancelScope(deadline=self._stop_deadline) as deadline:
                            self._deadline_scope = deadline
                            try:
                                await self._wait_idle(strict=True)
                            except TransportError as error:
                                # The broker cannot tell what it still holds (it is
                                # unreachable): close anyway; what this process holds
                                # is listed as abandoned, and the broker delivers it
                                # again once it is back.
                                logger.warning(
                                    "closing without knowing the broker's backlog: %s", error
                                )
                            else:
                                self._drained = True
                    finally:
                        asked = self._stop_requested is not None and self._stop_requested.is_set()
                        if not asked and self._loop_left_it_running():
                            # Nobody closed the bus and its event loop is ending: stop
                            # at once, list the work as abandoned, say so once (below).
                            self._left_running = asked = True
                            self._request_stop(-math.inf)  # (a broker: a short grace)
                        self._deadline_scope = None
                        with anyio.CancelScope(shield=True):
                            self._replies.close()
                            self._life.portal = None
                            await portal.stop(cancel_remaining=True)
                        task_group.cancel_scope.cancel()
            if not asked:
                # The task group ended without a stop asked for: its scope was
                # cancelled by something else (a task of the bus cancelled from
                # outside). Never a silent stop: ``async with bus`` raises this.
                self._fail(
                    BusClosedError(
                        "the bus stopped by itself: its task group ended without a "
                        "stop being requested (was its task group or one of its "
                        "tasks cancelled from outside the bus?)"
                    )
                )
        finally:
            self._life.task_group = None
            self._life.portal = None
            self._runner = None
            report = self._finish(self._drained, quiet=self._left_running)
            if self._left_running:
                _never_closed(self.name, report)
            if self._stopped is not None:
                self._stopped.set()
            host = self._host
            if self._fatal is not None and host is not None and not self._exiting:
                # Interrupt the body of ``async with bus``: its exit raises the error.
                host.cancel_scope.cancel()

    def _loop_left_it_running(self) -> bool:
        """Whether the bus's tasks end because the event loop ends with the bus running.

        On asyncio the runner cancels every task left (see ``loop_closing``); on trio
        the task that started the bus returned without closing it, and trio cancels
        the bus's abandoned task group (a trio task cannot outlive its nursery).
        """
        if current_backend() == "trio":
            running = {task.id for task in anyio.get_running_tasks()}
            return self._entered_by is not None and self._entered_by not in running
        return loop_closing()

    async def _wait_for_stop_request(self) -> None:
        """Wait until a stop is requested; a stray cancellation of the runner is ignored."""
        assert self._stop_requested is not None
        while True:
            try:
                await self._stop_requested.wait()
                return
            except anyio.get_cancelled_exc_class():
                if not stray_cancellation():
                    raise  # the bus's own, or the scope of its task group
                logger.warning(
                    "the runner task of bus %r was cancelled from outside the bus; ignored",
                    self.name,
                )

    def _fail(self, error: BaseException) -> None:
        """Stop the bus at once for ``error``, which its ``async with`` then raises."""
        if self._fatal is None:
            self._fatal = error
            logger.error("bus %r stops: %s", self.name, describe_error(error), exc_info=error)
        if self._life.state in ("running", "closing", "starting"):
            self._request_stop(-math.inf)

    async def _halt(self, error: BaseException) -> NoReturn:
        """A handler raised ``error`` (``KeyboardInterrupt``, ``SystemExit``): stop the bus.

        Not a handler failure: the bus stops at once, as on an exception in the body
        of ``async with bus``, whose exit (or ``aclose``) then raises ``error`` itself
        (the body is interrupted). The calling consumer keeps its envelope until the
        stop cancels it, so the envelope is listed in ``ShutdownReport.abandoned``:
        neither acked nor dead-lettered. Never returns.
        """
        self._fail(error)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    def _raise_fatal(self, *, again: bool = False) -> None:
        """Raise what stopped the bus by itself: once, or ``again`` (the ``async with`` exit)."""
        fatal = self._fatal
        if fatal is not None and (again or not self._fatal_raised):
            self._fatal_raised = True
            raise fatal

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._exiting = True
        try:
            if exc_type is not None:
                if self._life.state in ("running", "closing"):
                    self._request_stop(-math.inf)  # on an exception: cancel at once
                    assert self._stopped is not None
                    with anyio.CancelScope(shield=True):
                        await self._stopped.wait()
            else:
                await self.aclose()
        finally:
            host, self._host = self._host, None
            if host is not None:
                # The runner has finished: the host group is empty. The body's own
                # exception (if any) propagates unwrapped once this returns.
                await host.__aexit__(None, None, None)
        # What stopped the bus by itself replaces the body's exception (most often the
        # cancellation that interrupted the body for it), which stays its context.
        self._raise_fatal(again=True)

    async def aclose(self, timeout: float | None = 30.0) -> ShutdownReport:
        """Stop accepting outside publishes, drain, cancel what is left, and report.

        Routing-slip hops, retries, replies and ``$deadletter`` keep flowing until the
        bus is drained or ``timeout`` seconds have passed (``None``: no deadline); then
        the rest is cancelled and listed in the report's ``abandoned``.

        Callable from any task. A second call returns the first report; a call made
        while the bus is closing waits for it, and brings the deadline forward to its
        own if that is sooner. Called from inside the bus (a handler, or any task the
        bus runs), it cannot wait for its own end: it requests the stop and returns a
        provisional report (``drained`` False, nothing abandoned yet); the final one
        comes from the ``aclose``/``async with`` exit of the task that runs the bus.
        If the call is cancelled while it waits, the stop still happens, at once.

        :raises ConfigurationError: for a timeout that is not ``None`` or a finite
            number ``>= 0``; the bus is left as it was.
        """
        seconds = check_wait(timeout, "aclose(timeout)")
        if self._life.state == "starting":
            assert self._started is not None
            await self._started.wait()
        if self._life.state == "closed" or self._life.state == "new":
            self._raise_fatal()
            if self._report is None:
                self._report = self._make_report(drained=True, abandoned=[], scheduled=[])
            return self._report
        deadline = math.inf if seconds is None else anyio.current_time() + seconds
        inside = self._called_from_inside()
        self._request_stop(deadline)
        if inside:
            return self._make_report(drained=False, abandoned=[], scheduled=[])
        assert self._stopped is not None
        try:
            await self._stopped.wait()
        except BaseException:
            # Deliberate: the caller gave up waiting (cancelled, interrupted). The stop
            # goes on in the runner task, now, so later calls return in their own time.
            self._request_stop(-math.inf)
            raise
        self._raise_fatal()
        assert self._report is not None
        return self._report

    def _request_stop(self, deadline: float) -> None:
        """Ask the runner to stop: drain until ``deadline`` (the soonest asked), then cancel."""
        if self._life.state in ("running", "starting"):
            self._life.state = "closing"
        deadline = self._mode.close_by(deadline)  # (a broker keeps a grace to close)
        if deadline < self._stop_deadline:
            self._stop_deadline = deadline
            if self._deadline_scope is not None:
                self._deadline_scope.deadline = deadline
        assert self._stop_requested is not None
        self._stop_requested.set()

    def _called_from_inside(self) -> bool:
        """Whether the calling task would be cancelled by this bus's stop.

        True in a handler of this bus (its consumer, or code it runs through
        ``anyio.from_thread``) and in any task descending from the runner task.
        """
        handling = current_handling()
        if handling is not None and handling.host is self._services:
            return True
        runner = self._runner
        if runner is None:
            return False
        parents = {task.id: task.parent_id for task in anyio.get_running_tasks()}
        task: int | None = anyio.get_current_task().id
        seen: set[int] = set()
        while task is not None and task not in seen:
            if task == runner:
                return True
            seen.add(task)
            task = parents.get(task)
        return False

    def _finish(self, drained: bool = False, *, quiet: bool = False) -> ShutdownReport:
        if self._report is not None:
            return self._report
        if self._holds_switch_interval:
            self._holds_switch_interval = False
            release_switch_interval()
        # Acks written behind that the broker never got: those envelopes come back.
        for name, envelope_id in self._mode.lost_acks():
            stage = self._stages_by_name.get(name)
            if stage is not None:
                stage.ledger.ack_lost()
                stage.unsettled.append(envelope_id)
        abandoned: list[str] = []
        for stage in self._stages.values():
            abandoned += stage.close(log=not quiet)
        scheduled = self._time.keeper.abandon()
        self._services.failure_log.flush()
        self._background = 0
        self._life.state = "closed"
        # A call after this may run under another backend: yield through anyio again,
        # so it meets BusClosedError, not the old backend's yield.
        self._services.yield_now = self._services.publish_yield = checkpoint
        for waiter in self._services.idle_waiters:
            waiter.event.set()
        self._services.idle_waiters.clear()
        self._report = self._make_report(
            drained=drained and not abandoned, abandoned=abandoned, scheduled=scheduled
        )
        return self._report

    def _make_report(
        self, *, drained: bool, abandoned: list[str], scheduled: list[str]
    ) -> ShutdownReport:
        stages = self._stages.values()
        return ShutdownReport(
            drained=drained,
            published=sum(stage.ledger.published for stage in stages),
            completed=sum(stage.ledger.acked for stage in stages),
            dead_lettered=sum(stage.ledger.dead_lettered for stage in stages),
            abandoned=abandoned,
            scheduled=scheduled,
        )

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until every queue is empty and nothing is in flight or waiting for a retry.

        Thread-safe publishes made before the call (or by handlers it waits for) are
        waited for too. Awaited in a handler, it waits for everything but the
        handlers that are themselves draining (it would wait for itself otherwise; a
        batch handler leaves out its whole batch).

        :raises TimeoutError: when that has not happened within ``timeout`` seconds,
            saying what is still queued, in flight or on its way.
        :raises ConfigurationError: for a timeout that is not ``None`` or a finite
            number ``>= 0``.
        """
        seconds = check_wait(timeout, "drain(timeout)")
        handling = current_handling()
        stage = None
        # In a handler: what it holds (one envelope, or a batch's) is not waited for.
        in_hand = handling.in_hand() if handling is not None else 0
        if in_hand and handling is not None and handling.host is self._services:
            stage = handling.stage
            stage.draining += in_hand
            self._wake_drainers()  # another handler's drain may have waited for this one
        try:
            with anyio.move_on_after(seconds):
                await self._wait_idle(strict=stage is None)
                return
        finally:
            if stage is not None:
                stage.draining -= in_hand
        raise TimeoutError(_not_drained(self, timeout))

    async def _wait_idle(self, *, strict: bool) -> None:
        while True:
            while not self._idle(strict):
                if self._life.state == "closed":
                    return
                waiter = _DrainWaiter(strict)
                self._services.idle_waiters.append(waiter)
                try:
                    await waiter.event.wait()
                finally:
                    # Timed out or cancelled: leave nothing behind (a woken waiter was
                    # already taken off the list).
                    if not waiter.event.is_set():
                        with contextlib.suppress(ValueError):
                            self._services.idle_waiters.remove(waiter)
            if not await self._mode.backlog(self._stages.values()):
                return
            # Envelopes still in the broker for our stages: look again shortly.
            await anyio.sleep(0.02)

    def _idle(self, strict: bool = True) -> bool:
        if self._background or self._publisher.threadsafe_pending:
            return False
        if strict:
            return all(stage.idle for stage in self._stages.values())
        return all(stage.quiet for stage in self._stages.values())

    def _wake_drainers(self) -> None:
        """Release every ``drain()`` whose wait is over now."""
        if not self._services.idle_waiters or not self._idle(strict=False):
            return
        everything = self._idle(strict=True)
        waiting = []
        for waiter in self._services.idle_waiters:
            if everything or not waiter.strict:
                waiter.event.set()
            else:
                waiting.append(waiter)
        self._services.idle_waiters = waiting

    # -- subscribing ------------------------------------------------------------

    @overload
    def subscribe(
        self,
        topic: str,
        handler: None = None,
        *,
        group: str | None = None,
        concurrency: int | Adaptive = 1,
        capacity: int = 1024,
        backpressure: Backpressure = Backpressure.BLOCK,
        retry: Retry | None = None,
        timeout: float | None = None,
        offload: Literal["thread", "process", "inline"] | None = None,
        middleware: Sequence[Middleware] = (),
        admission: Admission | None = None,
        batch: Batch | None = None,
        ordering: Ordering | None = None,
        key_failure: KeyFailure = "continue",
        max_in_flight: int | None = None,
        partitions: int | None = None,
    ) -> Callable[[F], F]: ...

    @overload
    def subscribe(
        self,
        topic: str,
        handler: Callable[..., Any],
        *,
        group: str | None = None,
        concurrency: int | Adaptive = 1,
        capacity: int = 1024,
        backpressure: Backpressure = Backpressure.BLOCK,
        retry: Retry | None = None,
        timeout: float | None = None,
        offload: Literal["thread", "process", "inline"] | None = None,
        middleware: Sequence[Middleware] = (),
        admission: Admission | None = None,
        batch: Batch | None = None,
        ordering: Ordering | None = None,
        key_failure: KeyFailure = "continue",
        max_in_flight: int | None = None,
        partitions: int | None = None,
    ) -> Subscription: ...

    def subscribe(
        self,
        topic: str,
        handler: Callable[..., Any] | None = None,
        *,
        group: str | None = None,
        concurrency: int | Adaptive = 1,
        capacity: int = 1024,
        backpressure: Backpressure = Backpressure.BLOCK,
        retry: Retry | None = None,
        timeout: float | None = None,
        offload: Literal["thread", "process", "inline"] | None = None,
        middleware: Sequence[Middleware] = (),
        admission: Admission | None = None,
        batch: Batch | None = None,
        ordering: Ordering | None = None,
        key_failure: KeyFailure = "continue",
        max_in_flight: int | None = None,
        partitions: int | None = None,
    ) -> Callable[[F], F] | Subscription:
        """Register a handler for ``topic`` (NATS pattern: ``*`` one token, ``>`` the rest).

        As a decorator it returns the function unchanged; called with ``handler`` it
        returns the :class:`Subscription`. Subscribing while the bus runs takes effect
        at once, from any thread (from another thread than the event loop's, the stage
        and its consumers are made on the loop before this returns).

        :param concurrency: consumer tasks, or :class:`Adaptive` to let the stage find
            its own number from the handler's latency.
        :param admission: :class:`Admission` to shed stale envelopes (dead-lettered
            ``overload``) when the stage's queue stands; every subscription of a stage
            must give the same.
        :param batch: :class:`Batch` to call the handler once per list of envelopes'
            items (payloads; envelopes for ``list[Envelope]``; decoded models for
            ``list[Model]``); it may raise :class:`BatchError` to fail some positions only.
        :param ordering: ``"key"`` to handle the envelopes of one publish ``key=`` one at
            a time, in the order they were admitted (a retrying one holds its key: no
            overtaking), different keys in parallel up to the stage's concurrency;
            envelopes without a key are unordered. ``None`` (the default): unordered.
        :param key_failure: on an ordered stage, what a dead-lettered envelope does to
            the envelopes waiting for its key: ``"continue"`` (the default: the next one
            goes on) or ``"stop"`` (they are dead-lettered ``key_stopped`` with it, to be
            replayed in order once the cause is fixed).
        :param max_in_flight: the most handlers of this stage running at once in all
            the processes of its group together (``concurrency`` bounds one process):
            over Redis and NATS each is a lease in the broker, renewed while it runs and
            running out when its process dies; in memory, and over RabbitMQ, this
            process's. ``None`` (the default): no bound but ``concurrency``.
        :param partitions: with ``ordering="key"``, the number of partitions the group's
            keys are split into (1 to 4096). In memory one process serves them all, so
            the order per key holds whatever it is; over a broker, partitions owned by one
            replica each are not built yet: ``subscribe`` refuses it there.

        :raises BusClosedError: called from another thread while the bus stops.
        :raises ConfigurationError: for a malformed pattern or one the transport's
            broker cannot carry (:attr:`Transport.limits`), ``capacity`` or
            ``concurrency`` below 1, a non-callable handler, or a stage (same pattern
            and group) already configured with another capacity or back-pressure.
        """
        options: dict[str, Any] = {
            "group": group,
            "concurrency": concurrency,
            "capacity": capacity,
            "backpressure": backpressure,
            "retry": retry,
            "timeout": timeout,
            "offload": offload,
            "middleware": middleware,
            "admission": admission,
            "batch": batch,
            "ordering": ordering,
            "key_failure": key_failure,
            "max_in_flight": max_in_flight,
            "partitions": partitions,
        }
        if handler is None:
            # A malformed pattern or option fails here, as in the direct form, not when
            # the decorator is applied.
            policy, _, _ = check_options(topic, **options)
            self._mode.check_pattern(topic)
            self._mode.check_partitions(topic, partitions)
            joined = self._stages.get((topic, group)) if group is not None else None
            if joined is not None:
                _check_joins(
                    joined,
                    None,
                    capacity=capacity,
                    backpressure=policy,
                    admission=admission,
                    concurrency=concurrency,
                    ordering=ordering,
                    key_failure=key_failure,
                    max_in_flight=max_in_flight,
                    partitions=partitions,
                )

            def decorator(function: F) -> F:
                self._subscribe(make_subscription(topic, function, **options))
                return function

            return decorator
        subscription = make_subscription(topic, handler, **options)
        self._mode.check_pattern(topic)
        self._mode.check_partitions(topic, partitions)
        return self._subscribe(subscription)

    def _subscribe(self, subscription: Subscription) -> Subscription:
        if self._life.task_group is not None and threading.get_ident() != self._life.loop_thread:
            # From another thread (a sync handler's worker, say) while the bus runs: the
            # stage and its consumers are made on the event loop, or not at all.
            portal = self._life.portal
            ran = False

            def on_loop() -> Subscription:
                nonlocal ran
                ran = True
                return self._subscribe(subscription)

            try:
                if portal is None:
                    raise RuntimeError("the portal is closed")
                return portal.call(on_loop)
            except RuntimeError as error:
                if ran:
                    raise  # what subscribing raised on the loop
                raise BusClosedError(
                    f"subscribe({subscription.topic!r}): the bus stopped before the "
                    "subscription could start"
                ) from error
        key = (subscription.topic, subscription.group)
        stage = self._stages.get(key)
        if stage is not None:
            _check_joins(stage, subscription)
        chain = None
        if self._life.task_group is not None:
            assert self._pool is not None
            # Built before anything is registered: a middleware factory that raises
            # leaves the bus exactly as it was.
            chain = self._chain(subscription, self._pool)
        if stage is None:
            stage = Stage(
                self._services,
                subscription.topic,
                subscription.group,
                subscription.capacity,
                subscription.backpressure,
                admission=subscription.admission,
                controlled=isinstance(subscription.concurrency, Adaptive),
                ordered=subscription.ordering == "key",
                stop_key_on_failure=subscription.key_failure == "stop",
            )
            stage.partitions = subscription.partitions
            if subscription.max_in_flight is not None:
                stage.flights = FlightLimit(stage.name, subscription.max_in_flight)
            if self._life.task_group is not None:
                stage.open()
            self._stages[key] = stage
            self._stages_by_name[stage.name] = stage
            self._router.add(subscription.topic, subscription.group, stage)
        stage.subscriptions.append(subscription)
        if chain is not None:
            self._start(stage, subscription, chain)
        return subscription

    def _chain(self, subscription: Subscription, pool: WorkerPool) -> Handler:
        """The subscription's handler wrapped in its middleware (every factory runs here)."""
        handler = adapt_handler(subscription, pool, self._worker_niceness)
        return build_chain(subscription, handler, self._middleware)

    def _start(self, stage: Stage, subscription: Subscription, chain: Handler) -> None:
        if subscription.offload == "thread":
            if not self._told_pool:
                self._told_pool = True
                logger.info(
                    "bus %r: sync handlers (stage %r first) run on the worker thread pool, "
                    "%d at a time (workers=%d): %s",
                    self.name,
                    stage.name,
                    self.workers,
                    self.workers,
                    thread_pool_reason(),
                )
            if self._switch_interval is not None and not self._holds_switch_interval:
                self._holds_switch_interval = True
                hold_switch_interval(self._switch_interval)
        if stage.flights is not None:
            chain = stage.flights(chain)  # (outermost: a handler starts once it has a slot)
        start_consumers(stage, subscription, chain, self._services)
        self._mode.start(stage)

    # -- publishing (see ``_publishing.py``) -----------------------------------

    async def publish(
        self,
        topic: str,
        payload: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        slip: Sequence[str] = (),
        key: str | None = None,
        id: str | None = None,
        timeout: float | None = None,
        priority: Priority | int | None = None,
        delay: float | None = None,
        at: datetime | None = None,
        connection: Any = None,
    ) -> Receipt:
        """Publish ``payload`` on ``topic`` to every matching stage (once per group).

        :param delay: publish it this many seconds from now instead (see ``at``).
        :param at: publish it at this timezone-aware datetime instead: the envelope is
            held (by the bus in memory, by the broker otherwise) and published when
            due, as a publish at that moment would be; the receipt says when
            (``receipt.scheduled``) and ``bus.cancel_scheduled(receipt.id)`` cancels it.
        :param slip: topics the result is forwarded to, one after another.
        :param priority: a :class:`Priority` class (or its int, 0 to 2); stages with
            admission control serve higher classes first and shed lower ones first.
        :param ttl: seconds after which the envelope expires unhandled.
        :param timeout: longest wait for room in ``BLOCK`` stages.
        :param connection: an asyncpg connection inside the caller's open transaction:
            the envelope is written through it (by the bus's ``outbox``, else by a
            transport that writes in transactions, such as ``PostgresTransport``) and
            published if and only if that transaction commits, then delivered at least
            once. The receipt names no stage (nothing is routed before the commit);
            its ``id`` is the envelope's. Not with ``delay``/``at``
            (``ConfigurationError``).
        :raises BusClosedError: before start or after ``aclose`` began.
        :raises PublishTimeout: a ``BLOCK`` stage stayed full past ``timeout``
            (``.receipt`` tells which stages accepted).
        :raises ConfigurationError: for a malformed topic, or one the transport's
            broker cannot carry (:attr:`Transport.limits`): nothing is sent. With
            ``connection``: a bus that cannot write in a transaction, a connection that
            is not an asyncpg one or not inside a transaction, or ``delay``/``at``.
        :raises TransportError: with ``connection``, when the database refused the write.

        Every call yields to the event loop once, like anyio's ``send``: a publishing
        loop never starves other tasks. In memory it yields before it admits anything,
        and a publish cancelled at that yield admits nothing. (One cancelled later,
        while it waits for room in a ``BLOCK`` stage, keeps what earlier stages already
        admitted.) Over a broker the wait for the broker's confirmation is that yield: a
        publish whose cancel scope is already cancelled sends nothing; one cancelled
        while it waits may have been stored (at-least-once). A publish that raises (a
        closed bus, bad options, a payload its codec refuses) yields before it does.
        """
        await self._services.publish_yield()
        try:
            if delay is not None or at is not None or connection is not None:
                if connection is not None:
                    return await self._transactional.publish(
                        topic,
                        payload,
                        publish_options(headers, ttl, slip, key, id, timeout, priority),
                        connection,
                        delay is not None or at is not None,
                    )
                return await self._publish_later(
                    topic,
                    payload,
                    publish_options(headers, ttl, slip, key, id, timeout, priority),
                    delay,
                    at,
                )
            if (  # publish_options, inlined: the common publish has no options
                not headers
                and ttl is None
                and not slip
                and key is None
                and id is None
                and timeout is None
                and priority is None
            ):
                options = PLAIN
            else:
                options = make_options((headers, ttl, slip, key, id, timeout, priority))
            sent = self._publisher.publish(topic, payload, options)
            if isinstance(sent, Receipt):  # admitted inline: no coroutine of the publisher's
                return sent
            return await sent
        except Exception:
            # Refused (a closed bus, bad options, a payload the codec cannot take): over
            # a broker nothing may have yielded yet, and a loop that logs and goes on
            # must not starve the others.
            await cancel_shielded_checkpoint()
            raise

    async def publish_many(
        self,
        topic: str,
        payloads: Iterable[Any],
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        slip: Sequence[str] = (),
        key: str | None = None,
        timeout: float | None = None,
        priority: Priority | int | None = None,
        delay: float | None = None,
        at: datetime | None = None,
        connection: Any = None,
    ) -> list[Receipt]:
        """Publish one envelope per payload on ``topic``; their receipts, in payload order.

        ``delay``/``at`` hold them all until then, as for :meth:`publish`.

        Each envelope gets a fresh id (in order) and the same options, which mean what
        they mean for :meth:`publish` and are checked once. In memory each stage admits
        the envelopes in order with its policy (a ``BLOCK`` stage as room appears;
        ``REJECT`` and ``DROP_*`` outcomes are in each envelope's receipt); over a broker
        they go in one pipelined write. The call yields once, whatever the count.

        :param payloads: any iterable (a generator is read once); a ``str``, ``bytes``,
            ``bytearray`` or mapping is refused: it is one payload, not several.
        :param timeout: one deadline for the whole call's waits in ``BLOCK`` stages.
        :param connection: an asyncpg connection inside the caller's open transaction,
            as for :meth:`publish`: the envelopes are written through it, in order, and
            published if and only if it commits; their receipts name no stage.
        :raises BusClosedError: before start or after ``aclose`` began; cut off by the
            stop while it waited for room, with ``.receipt`` and ``.receipts`` as below.
        :raises PublishTimeout: a ``BLOCK`` stage stayed full past ``timeout``:
            ``.receipts`` holds the receipts of the envelopes published before,
            ``.receipt`` the partial one of the envelope that timed out; the envelopes
            after it were not published.
        :raises ConfigurationError: bad options or ``payloads``; with ``connection``,
            as for :meth:`publish`.
        :raises RuntimeError: called from another thread than the event loop's (use
            :meth:`publish_threadsafe` there); nothing is published.
        """
        await self._services.publish_yield()
        try:
            options = publish_options(headers, ttl, slip, key, None, timeout, priority)
            if connection is not None:
                return await self._transactional.publish_many(
                    topic, payloads, options, connection, delay is not None or at is not None
                )
            if delay is not None or at is not None:
                due = self._time.due(delay, at, f"publish_many({topic!r})")
                assert due is not None
                return await self._time.publish_many(topic, payloads, options, due)
            sent = self._publisher.publish_many(topic, payloads, options)
            if isinstance(sent, list):  # admitted inline
                return sent
            return await sent
        except Exception:
            await cancel_shielded_checkpoint()  # refused: yield all the same (see publish)
            raise

    def publish_nowait(
        self,
        topic: str,
        payload: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        slip: Sequence[str] = (),
        key: str | None = None,
        id: str | None = None,
        timeout: float | None = None,
        priority: Priority | int | None = None,
    ) -> Receipt:
        """Publish without waiting; nothing is admitted anywhere if a ``BLOCK`` stage is full.

        Takes the arguments of :meth:`publish`; ``timeout`` is accepted and has nothing
        to bound, since this never waits.

        Call it on the event loop's thread only (a handler, any task); from another
        thread (a sync handler's worker, say) use :meth:`publish_threadsafe`.

        :raises anyio.WouldBlock: when a matching ``BLOCK`` stage has no room.
        :raises BusClosedError: before start or after ``aclose`` began.
        :raises RuntimeError: called from another thread than the event loop's; nothing
            is admitted.
        """
        return self._publisher.publish_nowait(
            topic, payload, publish_options(headers, ttl, slip, key, id, timeout, priority)
        )

    def publish_threadsafe(
        self,
        topic: str,
        payload: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        slip: Sequence[str] = (),
        key: str | None = None,
        id: str | None = None,
        timeout: float | None = None,
        priority: Priority | int | None = None,
    ) -> concurrent.futures.Future[Receipt]:
        """Publish from any thread (worker threads included); the receipt arrives in a future.

        Errors (``BusClosedError``, ``PublishTimeout``, ``ConfigurationError``, ...) are
        set on the future, which always ends with a receipt or one of them, never
        cancelled: a publish the shutdown cuts off fails with ``BusClosedError``.
        Calls made one after another from one thread are admitted in that order, a
        full ``BLOCK`` stage included (without waiting for their futures).
        """
        return self._publisher.publish_threadsafe(
            topic, payload, publish_options(headers, ttl, slip, key, id, timeout, priority)
        )

    # -- requests ---------------------------------------------------------------

    async def request(
        self,
        topic: str,
        payload: Any = None,
        *,
        slip: Sequence[str] = (),
        timeout: float | None = 30.0,
        headers: Mapping[str, str] | None = None,
        ttl: float | None = None,
        delay: float | None = None,
        at: datetime | None = None,
    ) -> Any:
        """Publish and wait for the return value of the last stage of the route.

        ``delay``/``at`` hold the request until then, as for :meth:`publish`;
        ``timeout`` counts from the call, the wait for it included.

        :raises HandlerError: when no stage subscribes, a stage rejects it at the door,
            or it is dead-lettered anywhere on the route (the first failure wins).
        :raises TimeoutError: when no reply came within ``timeout``; the work goes on.
        """
        due = self._time.due(delay, at, f"request({topic!r})")
        hold = self._time.hold_request(due) if due is not None else None
        return await self._publisher.request(topic, payload, slip, timeout, headers, ttl, hold)

    async def _publish_later(
        self, topic: str, payload: Any, options: PublishOptions, delay: Any, at: Any
    ) -> Receipt:
        due = self._time.due(delay, at, f"publish({topic!r})")
        assert due is not None
        return await self._time.publish(topic, payload, options, due)

    # -- time -------------------------------------------------------------------

    async def cancel_scheduled(self, id: str) -> bool:
        """Cancel an envelope published with ``delay=``/``at=`` (``receipt.id``).

        :returns: ``True`` if it was still pending (it will never be published),
            ``False`` if it was published already, cancelled before, or unknown.
            Over a broker the broker's claim decides, in whichever process asks.
        """
        return await self._time.cancel(id)

    def scheduled(self) -> list[ScheduledEnvelope]:
        """The envelopes published with ``delay=``/``at=`` that are not due yet, soonest
        first (over a broker: the ones this process published; the broker holds every
        process's)."""
        return self._on_loop(self._time.listed)

    def schedule(
        self,
        topic: str,
        *,
        every: timedelta | float | None = None,
        cron: str | None = None,
        payload: Any = None,
        name: str | None = None,
        timezone: tzinfo | str | None = None,
        jitter: timedelta | float | None = None,
        catch_up: CatchUp = "skip",
        headers: Mapping[str, str] | None = None,
    ) -> Schedule:
        """Publish ``payload`` on ``topic`` at every tick, once per deployment.

        Replicas running the same code share the schedule by ``name`` (default: the
        topic and the timing): each tick is claimed in the broker and published by one
        of them (in memory, by this process). Ticks of ``every`` are counted from the
        epoch; ``cron`` (the ``cron`` extra) is read in ``timezone`` (default UTC),
        daylight-saving changes included. Each envelope's id is ``"{name}@{tick ms}"``
        and its header ``asyncbus-tick`` the tick.

        :param jitter: seconds (or a timedelta): each tick waits a random part of it.
        :param catch_up: ticks missed (the bus was down or late): ``"skip"`` them,
            publish the latest ``"one"``, or ``"all"`` of them.
        :raises ConfigurationError: not exactly one of ``every``/``cron``, a bad
            expression, time zone, jitter or ``catch_up``, or a name already scheduled.
        """
        made = make_schedule(
            topic,
            every=every,
            cron=cron,
            payload=payload,
            name=name,
            timezone=timezone,
            jitter=jitter,
            catch_up=catch_up,
            headers=check_headers(headers or {}, f"schedule({topic!r})"),
        )
        validate_topic(topic)
        self._mode.check_topic(topic)
        return self._on_loop(lambda: self._time.add(made))

    def periodic(
        self,
        *,
        every: timedelta | float | None = None,
        cron: str | None = None,
        name: str | None = None,
        timezone: tzinfo | str | None = None,
        jitter: timedelta | float | None = None,
        catch_up: CatchUp = "skip",
        payload: Any = None,
        **subscribe_options: Any,
    ) -> Callable[[F], F]:
        """Decorator: call the handler at every tick, once per deployment.

        The handler is subscribed (with ``subscribe_options``) to the topic
        ``periodic.{name}`` and a :meth:`schedule` of that name publishes ``payload``
        there; ``name`` defaults to the handler's ``module.qualname``. The handler takes
        the payload (or the envelope, for its ``asyncbus-tick`` header) or nothing.
        """

        def decorator(function: F) -> F:
            label = name or f"{function.__module__}.{function.__qualname__}"
            topic = periodic_topic(label)
            self.schedule(
                topic,
                every=every,
                cron=cron,
                payload=payload,
                name=label,
                timezone=timezone,
                jitter=jitter,
                catch_up=catch_up,
            )
            self.subscribe(topic, tick_handler(function), **subscribe_options)
            return function

        return decorator

    # -- statistics -------------------------------------------------------------

    def statistics(self) -> BusStatistics:
        """Snapshot every stage's ledger and the bus-wide totals.

        Safe from any thread: from another thread while the bus runs, the snapshot is
        taken on the event loop (where the counters change), so its ledgers balance.
        """
        return self._on_loop(self._statistics)

    def cluster_statistics(self) -> ClusterStatistics:
        """Every process of the deployment, and their sums.

        Over a broker that keeps heartbeats (Redis, NATS), every process whose bus
        shares this transport's prefix writes its statistics through the broker every
        ``heartbeat`` seconds: the view holds this process now and the others as the
        latest heartbeats said, each named by host and pid, those not heard from for
        three of their intervals marked ``stale``; ``totals`` sums them all. In memory,
        or over a broker without heartbeats (RabbitMQ), it is this process alone.
        Safe from any thread, as :meth:`statistics`.
        """
        return self._on_loop(self._cluster.view)

    def _on_loop(self, read: Callable[[], T]) -> T:
        """``read()`` on the thread that runs the bus (where its state lives), from any thread.

        From another thread it waits for the loop to run it; on the loop's thread, or
        when the bus is not running, it runs here.
        """
        portal = self._life.portal
        if portal is None or threading.get_ident() == self._life.loop_thread:
            return read()
        try:
            return portal.call(read)
        except (RuntimeError, concurrent.futures.CancelledError):
            return read()  # the portal stopped meanwhile: the bus is closing, nothing moves

    def _statistics(self) -> BusStatistics:
        stages = tuple(stage.statistics() for stage in self._stages.values())

        def total(field: str) -> int:
            return sum(getattr(stage, field) for stage in stages)

        return BusStatistics(
            stages=stages,
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
            dead_letter_queue=len(self.dead_letters),
            free_threaded=FREE_THREADED,
            deferred=total("deferred"),
            scheduled=self._time.keeper.count,
            schedules=tuple(
                schedule.statistics() for schedule in self._time.schedules.by_name.values()
            ),
        )

    # -- groups -----------------------------------------------------------------

    def groups(self) -> GroupListing:
        """The groups bound per topic pattern, with their backlog and consumers.

        In memory, this bus's stages, exact at the call. Over a broker, every group the
        broker keeps under the transport's prefix, every process's, ``local`` for those
        this process subscribes to: as the bus's latest reading of the broker has them
        (read at the start and every few seconds while the bus runs), or, awaited
        (``await bus.groups()``), read from the broker now. Sorted by pattern, then
        group.

        :raises BusClosedError: over a broker, when the bus is not running.
        :raises TransportError: awaited, when the transport cannot list groups or the
            broker fails; plainly, when the transport cannot list groups.
        """
        running = self._life.state in ("running", "closing")
        mode = self._mode
        return GroupListing(mode.groups_now(running), functools.partial(mode.groups, running))

    async def delete_group(self, pattern: str, group: str, *, force: bool = False) -> bool:
        """Delete the group (``pattern``, ``group``) and its backlog from the broker.

        For a group nothing reads any more (its handler was renamed, its service
        retired): later publishes neither reach it nor name it in their receipts, and
        nothing accumulates for it. A process that still subscribes to it binds it
        again, so stop those first.

        :param force: delete it although the broker counts consumers reading it.
        :returns: whether the group existed.
        :raises ConfigurationError: when this bus subscribes to it, or (unless
            ``force``) other processes' consumers read it.
        :raises BusClosedError: over a broker, when the bus is not running.
        :raises TransportError: when the transport cannot delete groups, or the broker fails.
        """
        return await self._mode.delete_group(
            pattern, group, force, self._life.state in ("running", "closing")
        )

    def __repr__(self) -> str:
        return f"<Bus {self.name!r} {self._life.state}, {len(self._stages)} stages>"


def _check_joins(
    stage: Stage,
    subscription: Subscription | None,
    *,
    capacity: int = 0,
    backpressure: Backpressure = Backpressure.BLOCK,
    admission: Admission | None = None,
    concurrency: int | Adaptive = 1,
    ordering: str | None = None,
    key_failure: str = "continue",
    max_in_flight: int | None = None,
    partitions: int | None = None,
) -> None:
    """Raise :class:`ConfigurationError` unless ``subscription`` can join ``stage``.

    Without a subscription (the decorator form, before its handler is given), the
    options it will have are checked.
    """
    if subscription is not None:
        capacity, backpressure = subscription.capacity, subscription.backpressure
        admission, concurrency = subscription.admission, subscription.concurrency
        ordering, key_failure = subscription.ordering, subscription.key_failure
        max_in_flight, partitions = subscription.max_in_flight, subscription.partitions
    if stage.partitions != partitions:
        raise ConfigurationError(
            f"stage {stage.name!r} already has partitions={stage.partitions!r}; a subscription "
            f"in the same group asked for partitions={partitions!r}"
        )
    has_limit = stage.flights.limit if stage.flights is not None else None
    if has_limit != max_in_flight:
        raise ConfigurationError(
            f"stage {stage.name!r} already has max_in_flight={has_limit!r}; a subscription "
            f"in the same group asked for max_in_flight={max_in_flight!r}"
        )
    gate = stage.gate
    has = ("key" if gate is not None else None, "stop" if gate and gate.stop else "continue")
    if has != (ordering, key_failure):
        raise ConfigurationError(
            f"stage {stage.name!r} already has ordering={has[0]!r}, key_failure={has[1]!r}; "
            f"a subscription in the same group asked for ordering={ordering!r}, "
            f"key_failure={key_failure!r}"
        )
    if (stage.capacity, stage.backpressure) != (capacity, backpressure):
        raise ConfigurationError(
            f"stage {stage.name!r} already has capacity={stage.capacity}, "
            f"backpressure={stage.backpressure.name}; a subscription in the same group "
            f"asked for capacity={capacity}, backpressure={backpressure.name}"
        )
    if (stage.control.admission if stage.control else None) != admission:
        raise ConfigurationError(
            f"stage {stage.name!r} already has admission="
            f"{stage.control.admission if stage.control else None!r}; a subscription in "
            f"the same group asked for admission={admission!r}"
        )
    if stage.control is None and isinstance(concurrency, Adaptive):
        raise ConfigurationError(
            f"stage {stage.name!r} runs a fixed concurrency; a subscription in the same "
            "group cannot be Adaptive (give the group's first subscription Adaptive or "
            "admission=)"
        )


def _never_closed(name: str, report: ShutdownReport) -> None:
    """Log, once, that the bus stopped because its event loop ended with it running."""
    ids = report.abandoned
    named = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    logger.error(
        "bus was never closed: use `async with bus`, `lifespan(bus)` or `await bus.aclose()` "
        "(bus %r stopped as its event loop ended; %d envelope(s) abandoned%s)",
        name,
        len(ids),
        f": {named}" if ids else "",
        extra={"asyncbus_envelope_ids": tuple(ids)},
    )


def _not_drained(bus: Bus, timeout: float | None) -> str:
    """What a ``drain(timeout)`` that ran out of time was still waiting for."""
    busy = [stage for stage in bus._stages.values() if not stage.idle]
    waiting: list[str] = []
    if busy:
        queued = sum(stage.queued for stage in busy)
        in_flight = sum(stage.in_flight for stage in busy)
        named = ", ".join(f"{s.name} {s.queued} + {s.in_flight}" for s in busy[:5])
        if len(busy) > 5:
            named += f" and {len(busy) - 5} more stage(s)"
        waiting.append(
            f"{queued} envelope(s) queued + {in_flight} in flight or waiting for a retry ({named})"
        )
        if entering := sum(stage.entering for stage in busy):
            waiting.append(f"{entering} publish(es) waiting for room")
    if bus._publisher.threadsafe_pending:
        waiting.append(
            f"{bus._publisher.threadsafe_pending} thread-safe publish(es) not yet routed"
        )
    if bus._background:
        waiting.append(f"{bus._background} dead-letter or announcement task(s)")
    if not waiting:
        waiting.append("envelopes still in the broker for this bus's stages")
    return f"not drained within {timeout}s: still {'; '.join(waiting)}"
