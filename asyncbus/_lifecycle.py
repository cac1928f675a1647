"""The bus's life cycle: its start, the runner task that owns the transport, the portal
and the task group, the stop with its deadline and report, and what stopped it by itself."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, NoReturn

import anyio
import anyio.abc
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal
from anyio.lowlevel import checkpoint

from ._clock import loop_clock
from ._exceptions import BusClosedError, ConfigurationError, TransportError
from ._failures import describe_error, loop_closing, stray_cancellation
from ._handling import current_handling
from ._runtime import current_backend, fast_checkpoint
from ._snapshots import shutdown_report
from ._stats import ShutdownReport

if TYPE_CHECKING:
    from ._cluster import ClusterWatch
    from ._dead_letters import DeadLetterQueue
    from ._draining import Draining
    from ._life import Life, State
    from ._modes import Mode
    from ._replies import Replies
    from ._services import Services
    from ._stage import Stage
    from ._subscribing import Subscribing
    from ._time.service import Timekeeping
    from ._transactional import Transactional

__all__ = ["Lifecycle"]

logger = logging.getLogger("asyncbus.bus")


class Lifecycle:
    """Starts and stops one bus (``async with bus``, ``aclose``), one per bus.

    One runner task owns the transport, the portal and the bus's task group; it also
    carries out the stop, so the stop happens whatever becomes of the caller that
    asked for it. What stopped the bus without a stop being asked for (a handler's
    ``KeyboardInterrupt``, its task group ending by itself) is raised from the
    ``async with bus`` exit or ``aclose`` once the bus has stopped.
    """

    def __init__(
        self,
        name: str,
        life: Life,
        mode: Mode,
        services: Services,
        draining: Draining,
        subscribing: Subscribing,
        transactional: Transactional,
        cluster: ClusterWatch,
        time: Timekeeping,
        replies: Replies,
        dead_letters: DeadLetterQueue,
    ) -> None:
        self._name = name
        self._life = life
        self._mode = mode
        self._services = services
        self._draining = draining
        self._subscribing = subscribing
        self._stages = subscribing.stages
        self._transactional = transactional
        self._cluster = cluster
        self._time = time
        self._replies = replies
        self._dead_letters = dead_letters
        #: The report of the bus's stop, once it stopped.
        self.report: ShutdownReport | None = None
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
        self._host: TaskGroup | None = None
        self._runner: int | None = None

    # -- start ------------------------------------------------------------------

    async def start(self) -> None:
        """``async with bus`` (``__aenter__``): start the bus, its subscriptions made.

        :raises RuntimeError: when the bus is already running.
        """
        if self._life.state in ("starting", "running", "closing"):
            raise RuntimeError("this Bus is already running")
        previous = self._life.state
        self._life.state = "starting"
        self._started = anyio.Event()
        try:
            await self._start(previous)
        finally:
            self._started.set()

    async def _start(self, previous: State) -> None:
        try:
            # Every middleware factory runs here, before anything starts: one that
            # raises leaves the bus as it was, with no task to clean up.
            chains = self._subscribing.prepare()
        except BaseException:  # deliberate: whatever a factory raises, undo the state
            self._life.state = previous
            raise
        self._life.loop_thread = threading.get_ident()
        self._services.yield_now = fast_checkpoint()
        self._services.publish_yield = self._mode.publish_yield(self._services.yield_now)
        self._dead_letters.use_clock(loop_clock())
        self._stop_requested = anyio.Event()
        self._stopped = anyio.Event()
        self._stop_deadline = math.inf
        self._drained = False
        self.report = None
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
            await host.start(self._run, name=f"asyncbus {self._name}")
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
            self._transactional.start(self._life.tasks(), self._life.is_running)
            self._subscribing.start_all(chains)
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

    async def subscribed(self) -> None:
        """``Bus.subscribed``: wait for every broker subscription; raise a refusal."""
        await self._subscribing.wait_subscribed()
        if self._refusals:
            first = self._refusals[0]
            self._refusals.clear()
            raise first

    def refused(self, stage: Stage, error: ConfigurationError) -> None:
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
            self._subscribing.withdraw(stage)
        if stage.subscribed is not None:
            stage.subscribed.set()  # (wakes subscribed())
        if self._services.idle_waiters:
            self._draining.wake()

    # -- the runner task --------------------------------------------------------

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
                await self._mode.open(stack, self._dead_letters)
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
                                await self._draining.wait_idle(strict=True)
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
                _never_closed(self._name, report)
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
                    self._name,
                )

    # -- what stops it by itself ------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """Stop the bus at once for ``error``, which its ``async with`` then raises."""
        if self._fatal is None:
            self._fatal = error
            logger.error("bus %r stops: %s", self._name, describe_error(error), exc_info=error)
        if self._life.state in ("running", "closing", "starting"):
            self._request_stop(-math.inf)

    async def halt(self, error: BaseException) -> NoReturn:
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

    # -- stop -------------------------------------------------------------------

    async def exit(self, failed: bool, aclose: Callable[[], Awaitable[ShutdownReport]]) -> None:
        """The ``async with bus`` exit: ``aclose()``, or at once when its body ``failed``."""
        self._exiting = True
        try:
            if failed:
                if self._life.state in ("running", "closing"):
                    self._request_stop(-math.inf)  # on an exception: cancel at once
                    assert self._stopped is not None
                    with anyio.CancelScope(shield=True):
                        await self._stopped.wait()
            else:
                await aclose()
        finally:
            host, self._host = self._host, None
            if host is not None:
                # The runner has finished: the host group is empty. The body's own
                # exception (if any) propagates unwrapped once this returns.
                await host.__aexit__(None, None, None)
        # What stopped the bus by itself replaces the body's exception (most often the
        # cancellation that interrupted the body for it), which stays its context.
        self._raise_fatal(again=True)

    async def close(self, seconds: float | None) -> ShutdownReport:
        """``Bus.aclose`` once its ``timeout`` is checked: stop, drain for ``seconds``
        (``None``: no deadline), cancel what is left, and report."""
        if self._life.state == "starting":
            assert self._started is not None
            await self._started.wait()
        if self._life.state == "closed" or self._life.state == "new":
            self._raise_fatal()
            if self.report is None:
                self.report = shutdown_report(
                    self._stages, drained=True, abandoned=[], scheduled=[]
                )
            return self.report
        deadline = math.inf if seconds is None else anyio.current_time() + seconds
        inside = self._called_from_inside()
        self._request_stop(deadline)
        if inside:
            return shutdown_report(self._stages, drained=False, abandoned=[], scheduled=[])
        assert self._stopped is not None
        try:
            await self._stopped.wait()
        except BaseException:
            # Deliberate: the caller gave up waiting (cancelled, interrupted). The stop
            # goes on in the runner task, now, so later calls return in their own time.
            self._request_stop(-math.inf)
            raise
        self._raise_fatal()
        assert self.report is not None
        return self.report

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
        if self.report is not None:
            return self.report
        self._subscribing.end_run()
        # Acks written behind that the broker never got: those envelopes come back.
        for name, envelope_id in self._mode.lost_acks():
            stage = self._subscribing.stages_by_name.get(name)
            if stage is not None:
                stage.ledger.ack_lost()
                stage.unsettled.append(envelope_id)
        abandoned: list[str] = []
        for stage in self._stages.values():
            abandoned += stage.close(log=not quiet)
        scheduled = self._time.keeper.abandon()
        self._services.failure_log.flush()
        self._services.background = 0
        self._life.state = "closed"
        # A call after this may run under another backend: yield through anyio again,
        # so it meets BusClosedError, not the old backend's yield.
        self._services.yield_now = self._services.publish_yield = checkpoint
        self._draining.release()
        self.report = shutdown_report(
            self._stages,
            drained=drained and not abandoned,
            abandoned=abandoned,
            scheduled=scheduled,
        )
        return self.report


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
