"""The bus: subscriptions become stages, publishes are routed to them, shutdown is accounted."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime, timedelta, tzinfo
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

from anyio.abc import TaskGroup
from anyio.lowlevel import cancel_shielded_checkpoint

from ._adaptive import Adaptive
from ._admission import Admission, Priority
from ._batch import Batch
from ._carry import ContextVarCarrier, checked_contextvars
from ._checks import check_count, check_headers, check_seconds, check_wait
from ._cluster import ClusterStatistics, ClusterWatch, check_heartbeat
from ._dead_lettering import DeadLettering
from ._dead_letters import DEADLETTER_TOPIC
from ._draining import Draining
from ._envelope import Envelope, Receipt
from ._exceptions import ConfigurationError
from ._groups import GroupListing
from ._life import Life
from ._lifecycle import Lifecycle
from ._modes import Mode, choose_mode
from ._modes.stale_groups import check_stale_after
from ._options import PLAIN, PublishOptions, make_options, publish_options
from ._ordering import KeyFailure, Ordering
from ._publishing import Publisher
from ._replies import Replies
from ._routing import Router, validate_topic
from ._services import Services
from ._snapshots import bus_statistics
from ._stage import Backpressure, Stage
from ._stats import BusStatistics, ShutdownReport
from ._subscribing import Subscribing
from ._subscription import Subscription, check_middleware, make_subscription
from ._time.held import ScheduledEnvelope
from ._time.periodic import CatchUp, Schedule, make_schedule, periodic_topic, tick_handler
from ._time.service import Timekeeping
from ._transactional import Transactional
from ._types import Middleware
from .middleware.retry import Retry
from .transports.base import Transport

__all__ = ["DEADLETTER_TOPIC", "Bus"]

F = TypeVar("F", bound=Callable[..., Any])


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
    :param heartbeat: over a broker that keeps heartbeats (Redis, NATS, PostgreSQL),
        seconds between two heartbeats of this process (its identity and statistics,
        written through the broker) that make :meth:`cluster_statistics` the whole
        deployment's view; at most 60. ``None`` turns them off.
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
        self.name = name
        #: Where envelopes wait; ``None`` or a :class:`MemoryTransport` keeps them in
        #: the stages' own streams.
        self.transport = transport
        self.workers = workers
        #: Where the bus is in its life, as the publisher reads it.
        self._life = Life()
        self._services = Services(self._life)
        self._router: Router[Stage] = Router()
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
        #: Subscriptions made stages, their consumers started (see ``_subscribing.py``).
        self._subscribing = Subscribing(
            name,
            workers,
            layers,
            switch_interval,
            worker_niceness,
            self._services,
            self._mode,
            self._life,
            self._router,
            self._stages,
            self._stages_by_name,
        )
        #: ``drain()``, and when the bus is idle (see ``_draining.py``).
        self._draining = Draining(self._services, self._stages, self._mode, self._life)
        self._publisher = Publisher(
            name,
            self._life,
            self._draining.wake,
            self._mode,
            self._services,
            self._router,
            self._observers,
        )
        self._draining.publisher = self._publisher
        self._replies = Replies(
            name,
            self._mode,
            self._services,
            self._publisher.send,
            self._subscribing.subscribe,
            self._subscribing.wait_subscribed,
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
            time.monotonic,  # (the event loop's clock once the bus starts)
        )
        #: Dead letters of every stage, newest last.
        self.dead_letters = self._dead_lettering.queue
        #: The statistics now (see ``_snapshots.py``), read on the bus's thread.
        self._statistics = functools.partial(
            bus_statistics,
            self._stages,
            self.dead_letters,
            self._time,
            self._transactional.pending,
        )
        #: This process's heartbeat and the view of the deployment's (``cluster_statistics``).
        self._cluster = ClusterWatch(
            name,
            self._statistics,
            heartbeat or 5.0,
            self._mode.heartbeats() if heartbeat is not None else None,
            self._mode.cleanup_scope,
        )
        #: Start, stop, and what stopped the bus by itself (see ``_lifecycle.py``).
        self._lifecycle = Lifecycle(
            name,
            self._life,
            self._mode,
            self._services,
            self._draining,
            self._subscribing,
            self._transactional,
            self._cluster,
            self._time,
            self._replies,
            self.dead_letters,
        )
        self._services.connect(
            self._mode, self._draining, self._replies, self._dead_lettering, self._lifecycle
        )
        if carried:
            self._services.instrumentation = ContextVarCarrier(carried)

    # -- life cycle -------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the bus accepts publishes from outside its handlers."""
        return self._life.state == "running"

    @property
    def _report(self) -> ShutdownReport | None:
        """The report of the bus's last stop (``None`` until it stopped)."""
        return self._lifecycle.report

    def _tasks(self) -> TaskGroup:
        """The one task group that owns every task of the running bus."""
        return self._life.tasks()

    async def __aenter__(self) -> Bus:
        await self._lifecycle.start()
        return self

    async def subscribed(self) -> None:
        """Wait until every stage's broker subscription exists (at once in memory).

        ``async with bus`` waits for this itself; after a ``subscribe`` on a running
        bus over a broker, await it before publishing what the new group must get.

        :raises ConfigurationError: when the broker refused a subscription for good
            (a pattern it cannot take) since the last call: that subscription was
            withdrawn and the rest of the bus runs on as it was.
        """
        await self._lifecycle.subscribed()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._lifecycle.exit(exc_type is not None, self.aclose)

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
        return await self._lifecycle.close(check_wait(timeout, "aclose(timeout)"))

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
        await self._draining.drain(timeout)

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
            over Redis, NATS and PostgreSQL each is a lease in the broker, renewed while
            it runs and running out when its process dies; in memory, and over RabbitMQ, this
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
            self._subscribing.check(topic, options)

            def decorator(function: F) -> F:
                self._subscribing.subscribe(make_subscription(topic, function, **options))
                return function

            return decorator
        subscription = make_subscription(topic, handler, **options)
        self._mode.check_pattern(topic)
        self._mode.check_partitions(topic, partitions)
        return self._subscribing.subscribe(subscription)

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
        return self._life.on_loop(self._time.listed)

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
        return self._life.on_loop(lambda: self._time.add(made))

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
        return self._life.on_loop(self._statistics)

    def cluster_statistics(self) -> ClusterStatistics:
        """Every process of the deployment, and their sums.

        Over a broker that keeps heartbeats (Redis, NATS, PostgreSQL), every process whose
        bus shares this transport's prefix (schema) writes its statistics through the broker every
        ``heartbeat`` seconds: the view holds this process now and the others as the
        latest heartbeats said, each named by host and pid, those not heard from for
        three of their intervals marked ``stale``; ``totals`` sums them all. In memory,
        or over a broker without heartbeats (RabbitMQ), it is this process alone.
        Safe from any thread, as :meth:`statistics`.
        """
        return self._life.on_loop(self._cluster.view)

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
