"""Subscribing: each subscription made a stage's (a new stage, or one of its group it
joins), its chain built and, on the running bus, its consumers started."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ._batching import start_consumers
from ._chain import adapt_handler, build_chain
from ._exceptions import BusClosedError, ConfigurationError
from ._flights import FlightLimit
from ._offload import (
    WorkerPool,
    hold_switch_interval,
    release_switch_interval,
    thread_pool_reason,
)
from ._stage import Stage
from ._subscription import StageOptions, Subscription, check_options, stage_options

if TYPE_CHECKING:
    from ._life import Life
    from ._modes import Mode
    from ._routing import Router
    from ._services import Services
    from ._types import Handler, Middleware

__all__ = ["Subscribing"]

logger = logging.getLogger("asyncbus.bus")


class Subscribing:
    """Makes one bus's subscriptions into stages and runs their consumers.

    It keeps the bus's stage tables (by pattern and group, by name) and the router
    up to date, and the worker pool of the bus's run (:attr:`pool`).
    """

    __slots__ = (
        "_holds_switch_interval",
        "_life",
        "_middleware",
        "_mode",
        "_name",
        "_router",
        "_services",
        "_switch_interval",
        "_told_pool",
        "_worker_niceness",
        "_workers",
        "pool",
        "stages",
        "stages_by_name",
    )

    def __init__(
        self,
        name: str,
        workers: int,
        middleware: tuple[Middleware, ...],
        switch_interval: float | None,
        worker_niceness: int | None,
        services: Services,
        mode: Mode,
        life: Life,
        router: Router[Stage],
        stages: dict[tuple[str, str], Stage],
        stages_by_name: dict[str, Stage],
    ) -> None:
        self._name = name
        self._workers = workers
        self._middleware = middleware
        self._switch_interval = switch_interval
        self._worker_niceness = worker_niceness
        self._services = services
        self._mode = mode
        self._life = life
        self._router = router
        #: The stages by (pattern, group) and by name.
        self.stages = stages
        self.stages_by_name = stages_by_name
        #: The worker pool of the bus's run (made at each start).
        self.pool: WorkerPool | None = None
        self._holds_switch_interval = False
        #: Whether this run of the bus said which pool its sync handlers run on.
        self._told_pool = False

    def check(self, topic: str, options: dict[str, Any]) -> None:
        """Raise :class:`ConfigurationError` unless a subscription to ``topic`` with
        ``options`` can be made (the decorator form, before its handler is given)."""
        policy, _, _ = check_options(topic, **options)
        self._mode.check_pattern(topic)
        self._mode.check_partitions(topic, options["partitions"])
        group = options["group"]
        joined = self.stages.get((topic, group)) if group is not None else None
        if joined is not None:
            _check_joins(
                joined,
                stage_options(
                    capacity=options["capacity"],
                    backpressure=policy,
                    admission=options["admission"],
                    concurrency=options["concurrency"],
                    ordering=options["ordering"],
                    key_failure=options["key_failure"],
                    max_in_flight=options["max_in_flight"],
                    partitions=options["partitions"],
                ),
            )

    def subscribe(self, subscription: Subscription) -> Subscription:
        """Make ``subscription`` its stage's, and start its consumers if the bus runs."""
        if self._life.task_group is not None and threading.get_ident() != self._life.loop_thread:
            # From another thread (a sync handler's worker, say) while the bus runs: the
            # stage and its consumers are made on the event loop, or not at all.
            portal = self._life.portal
            ran = False

            def on_loop() -> Subscription:
                nonlocal ran
                ran = True
                return self.subscribe(subscription)

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
        stage = self.stages.get(key)
        if stage is not None:
            _check_joins(stage, subscription.stage_options)
        chain = None
        if self._life.task_group is not None:
            assert self.pool is not None
            # Built before anything is registered: a middleware factory that raises
            # leaves the bus exactly as it was.
            chain = self.chain(subscription, self.pool)
        if stage is None:
            shape = subscription.stage_options
            stage = Stage(
                self._services,
                subscription.topic,
                subscription.group,
                shape.capacity,
                shape.backpressure,
                admission=shape.admission,
                controlled=shape.adaptive,
                ordered=shape.ordering == "key",
                stop_key_on_failure=shape.key_failure == "stop",
            )
            stage.options = shape
            stage.partitions = shape.partitions
            stage.partitioned = self._mode.partitions(stage, shape.partitions)
            if shape.max_in_flight is not None:
                stage.flights = FlightLimit(stage.name, shape.max_in_flight)
            if self._life.task_group is not None:
                stage.open()
            self.stages[key] = stage
            self.stages_by_name[stage.name] = stage
            self._router.add(subscription.topic, subscription.group, stage)
        stage.subscriptions.append(subscription)
        if chain is not None:
            self.start(stage, subscription, chain)
        return subscription

    def prepare(self) -> list[tuple[Stage, Subscription, Handler]]:
        """A new run's worker pool and every subscription's chain (every middleware
        factory runs here, before anything starts: one that raises changes nothing)."""
        pool = WorkerPool(self._workers)
        chains = [
            (stage, subscription, self.chain(subscription, pool))
            for stage in self.stages.values()
            for subscription in stage.subscriptions
        ]
        self.pool = pool
        self._told_pool = False
        return chains

    def start_all(self, chains: list[tuple[Stage, Subscription, Handler]]) -> None:
        """Start the consumers of :meth:`prepare`'s ``chains``, then of the subscriptions
        made since."""
        assert self.pool is not None
        built = {id(subscription) for _, subscription, _ in chains}
        for stage, subscription, chain in chains:
            self.start(stage, subscription, chain)
        for stage in list(self.stages.values()):  # subscribed while it started
            for subscription in stage.subscriptions:
                if id(subscription) not in built:
                    self.start(stage, subscription, self.chain(subscription, self.pool))

    def chain(self, subscription: Subscription, pool: WorkerPool) -> Handler:
        """The subscription's handler wrapped in its middleware (every factory runs here)."""
        handler = adapt_handler(subscription, pool, self._worker_niceness)
        return build_chain(subscription, handler, self._middleware)

    def start(self, stage: Stage, subscription: Subscription, chain: Handler) -> None:
        """Start ``subscription``'s consumers on ``stage``, each running ``chain``."""
        if subscription.offload == "thread":
            if not self._told_pool:
                self._told_pool = True
                logger.info(
                    "bus %r: sync handlers (stage %r first) run on the worker thread pool, "
                    "%d at a time (workers=%d): %s",
                    self._name,
                    stage.name,
                    self._workers,
                    self._workers,
                    thread_pool_reason(),
                )
            if self._switch_interval is not None and not self._holds_switch_interval:
                self._holds_switch_interval = True
                hold_switch_interval(self._switch_interval)
        if stage.flights is not None:
            chain = stage.flights(chain)  # (a handler starts once it has a slot)
        if stage.partitioned is not None:
            chain = stage.partitioned.guard(chain)  # (outermost: no slot for one given back)
        start_consumers(stage, subscription, chain, self._services)
        self._mode.start(stage)

    def end_run(self) -> None:
        """The bus stopped: give back the switch interval it held for thread stages."""
        if self._holds_switch_interval:
            self._holds_switch_interval = False
            release_switch_interval()

    async def wait_subscribed(self) -> None:
        """Wait until every stage's broker subscription exists or was refused."""
        for stage in list(self.stages.values()):
            if stage.subscribed is not None:
                await stage.subscribed.wait()

    def withdraw(self, stage: Stage) -> None:
        """Take ``stage`` out of the bus (its subscription was refused): out of the
        tables and the router, closed, its consumers woken to end."""
        key = (stage.pattern, stage.group)
        if self.stages.get(key) is stage:
            del self.stages[key]
            del self.stages_by_name[stage.name]
            self._router.remove(stage)
        stage.withdraw()
        self._services.forget(stage)


def _check_joins(stage: Stage, joining: StageOptions) -> None:
    """Raise :class:`ConfigurationError` unless a subscription asking for ``joining``
    can join ``stage`` (its group's options are those of the stage's first one)."""
    assert stage.options is not None  # (set when the stage was made)
    conflict = stage.options.conflict(joining, stage.name)
    if conflict is not None:
        raise ConfigurationError(conflict)
