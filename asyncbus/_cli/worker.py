"""One worker process: run the bus until a signal, drain with a deadline, report, exit.

The first SIGTERM or SIGINT stops the bus gracefully: ``aclose(graceful_timeout)``
(``/readyz`` says 503 from then on, publishes from outside are refused, what is queued
or in flight finishes until the deadline). A second one forces the stop: the deadline
is brought to now, what is left is cancelled and listed as abandoned. Either way the
:class:`~asyncbus.ShutdownReport` is logged and decides the exit status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .._bus import Bus
from .._exceptions import ConfigurationError
from .._stats import ShutdownReport
from . import CommandError, Exit, logger
from .target import running_bus

__all__ = ["Stop", "WorkerSettings", "work"]


#: Seconds between two looks at whether the supervisor is still there.
_PARENT_POLL = 1.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    """What one worker process needs to know besides its target.

    :ivar name: the target as given (``module:attribute``), for messages.
    :ivar index: this worker's number under a supervisor (``None``: alone).
    :ivar supervisor: the supervisor's pid: the worker stops when it goes away.
    """

    name: str
    graceful_timeout: float
    admin: socket.socket | None = None
    metrics: bool = False
    index: int | None = None
    supervisor: int | None = None


class Stop:
    """The stop requests a worker has received: the first drains, the second forces."""

    def __init__(self) -> None:
        self.requested = anyio.Event()
        self.forced = anyio.Event()
        self.reason = ""
        #: The scope of the bus's start, while it starts: a stop cancels it.
        self.while_starting: anyio.CancelScope | None = None

    def request(self, reason: str) -> None:
        """Ask for a graceful stop; asking again forces it."""
        if self.requested.is_set():
            if not self.forced.is_set():
                logger.warning("%s again: stopping at once, cancelling what is left", reason)
                self.forced.set()
            return
        self.reason = reason
        self.requested.set()
        if self.while_starting is not None:
            self.while_starting.cancel()


async def work(target: object, settings: WorkerSettings, early: Callable[[], str | None]) -> int:
    """Run ``target`` until stopped; return the exit status (see :class:`Exit`).

    :param early: the signal that arrived before the event loop took over, if any.
    """
    stop = Stop()
    with anyio.open_signal_receiver(*_STOP_SIGNALS) as signals:
        arrived = early()
        if arrived is not None:
            logger.info("%s before the bus started: not starting it", arrived)
            return Exit.OK
        async with anyio.create_task_group() as tasks:

            async def watch_signals() -> None:
                async for number in signals:
                    stop.request(signal.Signals(number).name)

            tasks.start_soon(watch_signals, name="asyncbus signals")
            if settings.supervisor is not None:
                tasks.start_soon(_watch_parent, settings.supervisor, stop)
            try:
                code = await _run(target, settings, stop, tasks)
            finally:
                tasks.cancel_scope.cancel()
    return code


async def _watch_parent(supervisor: int, stop: Stop) -> None:
    """Stop gracefully when the supervisor is gone (killed without passing a signal on)."""
    while os.getppid() == supervisor:
        await anyio.sleep(_PARENT_POLL)
    stop.request("the supervisor went away")


async def _run(target: object, settings: WorkerSettings, stop: Stop, tasks: TaskGroup) -> int:
    try:
        with anyio.CancelScope() as starting:
            stop.while_starting = starting
            async with running_bus(target, settings.name) as bus:
                stop.while_starting = None
                async with _admin(bus, settings, tasks):
                    _tell_running(bus, settings)
                    await stop.requested.wait()
                    report = await _drain(bus, settings, stop, tasks)
                    code = _tell_report(bus, report, settings.graceful_timeout)
            return code
        logger.info("%s while the bus started: stopped", stop.reason)
        return Exit.OK
    except BaseException as caught:
        error = caught
        # An app's lifespan runs in a task group: one error comes wrapped in a group.
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        if isinstance(error, CommandError):
            return error.tell()
        if isinstance(error, ConfigurationError):
            return CommandError(f"the bus refused its configuration: {error}").tell()
        if isinstance(error, Exception):
            # (The bus's own log named each stage's abandoned envelopes, if any.)
            logger.error("the bus crashed: %s: %s", type(error).__name__, error, exc_info=error)
            return Exit.CRASHED
        if isinstance(error, KeyboardInterrupt | SystemExit):
            logger.error("a handler raised %s: the bus stopped at once", type(error).__name__)
            return Exit.CRASHED
        raise


def _admin(
    bus: Bus, settings: WorkerSettings, tasks: TaskGroup
) -> contextlib.AbstractAsyncContextManager[None]:
    if settings.admin is None:
        return contextlib.nullcontext()
    from .admin import serving

    return serving(bus, settings.admin, tasks, metrics=settings.metrics)


def _tell_running(bus: Bus, settings: WorkerSettings) -> None:
    stages = bus.statistics().stages
    where = bus.transport.name if bus.transport is not None else "memory"
    extra: dict[str, Any] = {"asyncbus_event": "running"}
    process = f"pid {os.getpid()}"
    if settings.index is not None:
        process = f"worker {settings.index}, {process}"
        extra["asyncbus_worker"] = settings.index
    logger.info(
        "running bus %r from %s (%s): %d stage(s) over %s; SIGTERM or Ctrl-C drains it for "
        "up to %gs, a second one stops it at once",
        bus.name,
        settings.name,
        process,
        len(stages),
        where,
        settings.graceful_timeout,
        extra=extra,
    )


async def _drain(
    bus: Bus, settings: WorkerSettings, stop: Stop, tasks: TaskGroup
) -> ShutdownReport:
    logger.info(
        "%s: draining for up to %gs (again to stop at once)", stop.reason, settings.graceful_timeout
    )

    async def force() -> None:
        await stop.forced.wait()
        await bus.aclose(0)

    tasks.start_soon(force, name="asyncbus forced stop")
    return await bus.aclose(settings.graceful_timeout)


def _tell_report(bus: Bus, report: ShutdownReport, timeout: float) -> int:
    fields: dict[str, Any] = {
        "drained": report.drained,
        "published": report.published,
        "completed": report.completed,
        "dead_lettered": report.dead_lettered,
        "abandoned": list(report.abandoned),
    }
    extra = {"asyncbus_event": "stopped", "asyncbus_report": fields}
    counts = (
        f"published {report.published}, completed {report.completed}, dead-lettered "
        f"{report.dead_lettered}, abandoned {len(report.abandoned)}"
    )
    if report.drained:
        logger.info("bus %r stopped, drained: %s", bus.name, counts, extra=extra)
        return Exit.OK
    logger.warning(
        "bus %r stopped without draining (deadline %gs, or stopped at once): %s",
        bus.name,
        timeout,
        counts,
        extra=extra,
    )
    return Exit.ABANDONED
