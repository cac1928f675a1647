"""``--workers N`` and ``--reload``: worker processes under one supervisor.

Each worker is ``python -m asyncbus run`` in a child process, in a session of its own
(a Ctrl-C in the terminal reaches the supervisor alone, which passes it on once). The
supervisor:

* passes SIGTERM and SIGINT on to every worker: the first drains them, a second stops
  them at once; a worker still running ``graceful_timeout`` + 5 s after the first is
  killed;
* restarts a worker that exits while nothing asked it to, after a back-off doubling from
  0.5 s to 10 s (reset once a worker has run for a minute); after more than
  ``--max-restarts`` such exits within ``--restart-window`` seconds it gives up: stops
  the others and exits 1;
* stops everything and exits 2 when a worker cannot load its target (it never will);
* with ``--reload``, restarts every worker when a watched file changes, and waits for
  the next change when the target cannot be loaded or the workers keep crashing;
* binds ``--admin`` once and hands the socket to worker 0.

Its exit status is the worst of its workers' last ones (1 over 3 over 0), or its own 1
or 2 when it gave up.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import anyio
from anyio.abc import Process

from . import Exit, logger

__all__ = ["supervise"]


_FIRST_BACKOFF = 0.5
_MAX_BACKOFF = 10.0
#: A worker that ran this long before exiting starts its back-off afresh.
_STABLE_RUN = 60.0
#: Seconds past the graceful timeout after which a worker that has not stopped is killed.
_KILL_AFTER = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


async def _cancel_on(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


class _Slot:
    """One worker's place: the process in it now, and its restarts."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.process: Process | None = None
        self.failures = 0
        self.restart_now = anyio.Event()
        self.reloading = False
        self.last_code: int | None = None

    def signal(self, number: int) -> None:
        process = self.process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.Signals(number))


class Supervisor:
    """Runs and restarts the workers; see the module docstring."""

    def __init__(self, arguments: argparse.Namespace, argv: Callable[[int, int | None], list[str]]):
        self.arguments = arguments
        self.argv = argv
        self.slots = [_Slot(index) for index in range(arguments.workers)]
        self.stopping = anyio.Event()
        self.forced = False
        self.code: int | None = None  # the supervisor's own verdict, when it gave up
        self.crashes: collections.deque[float] = collections.deque()
        self.changed = anyio.Event()
        self.admin_fd: int | None = None

    # -- stopping ---------------------------------------------------------------

    def stop(self, number: int, reason: str) -> None:
        """Pass a stop signal on to every worker (the second one forces them)."""
        if self.stopping.is_set():
            if self.forced:
                return
            self.forced = True
            logger.warning("%s again: the workers stop at once", reason)
        else:
            logger.info(
                "%s: stopping the workers (they drain for up to %gs)",
                reason,
                self.arguments.graceful_timeout,
            )
            self.stopping.set()
        for slot in self.slots:
            slot.signal(number)

    def give_up(self, code: Exit, message: str) -> None:
        """Stop every worker and exit with ``code``."""
        if self.code is None:
            self.code = code
            logger.error("asyncbus run: %s", message)
        self.stop(signal.SIGTERM, "gave up")

    # -- the workers ------------------------------------------------------------

    async def run(self) -> int:
        async with anyio.create_task_group() as tasks:
            with anyio.open_signal_receiver(*_SIGNALS) as signals:
                tasks.start_soon(self._watch_signals, signals)
                if self.arguments.reload:
                    tasks.start_soon(self._watch_files)
                async with anyio.create_task_group() as slots:
                    for slot in self.slots:
                        slots.start_soon(self._keep, slot)
                tasks.cancel_scope.cancel()
        if self.code is not None:
            return self.code
        codes = [slot.last_code for slot in self.slots if slot.last_code is not None]
        if any(code not in (Exit.OK, Exit.ABANDONED) for code in codes):
            return Exit.CRASHED
        return Exit.ABANDONED if Exit.ABANDONED in codes else Exit.OK

    async def _watch_signals(self, signals: AsyncIterator[int]) -> None:
        async for number in signals:
            self.stop(number, signal.Signals(number).name)

    async def _keep(self, slot: _Slot) -> None:
        """Keep a worker running in ``slot`` until the supervisor stops."""
        while not self.stopping.is_set():
            started = time.monotonic()
            code = await self._run_one(slot)
            slot.last_code = code
            if self.stopping.is_set():
                return
            if slot.reloading:
                slot.reloading = False
                continue
            if code == Exit.USAGE:
                if await self._wait_for_change(slot, "cannot load its target"):
                    continue
                self.give_up(Exit.USAGE, f"worker {slot.index} cannot load its target")
                return
            if time.monotonic() - started >= _STABLE_RUN:
                slot.failures = 0
            slot.failures += 1
            now = time.monotonic()
            self.crashes.append(now)
            while self.crashes and self.crashes[0] < now - self.arguments.restart_window:
                self.crashes.popleft()
            if len(self.crashes) > self.arguments.max_restarts:
                message = (
                    f"workers exited {len(self.crashes)} times within "
                    f"{self.arguments.restart_window:g}s (the last: worker {slot.index} "
                    f"{_describe_exit(code)}); giving up"
                )
                if await self._wait_for_change(slot, "keeps crashing"):
                    self.crashes.clear()
                    continue
                self.give_up(Exit.CRASHED, message)
                return
            delay = min(_FIRST_BACKOFF * 2 ** (slot.failures - 1), _MAX_BACKOFF)
            logger.warning(
                "worker %d (pid %s) %s; restarting it in %gs",
                slot.index,
                slot.process.pid if slot.process is not None else "?",
                _describe_exit(code),
                delay,
            )
            await self._pause(slot, delay)

    async def _pause(self, slot: _Slot, delay: float) -> None:
        """Wait ``delay`` seconds, less if the supervisor stops or a file changes."""
        with anyio.move_on_after(delay):
            async with anyio.create_task_group() as waiting:
                for event in (self.stopping, slot.restart_now):
                    waiting.start_soon(_cancel_on, event, waiting.cancel_scope)

    async def _wait_for_change(self, slot: _Slot, why: str) -> bool:
        """With ``--reload``: wait for a file to change (True) or the stop (False)."""
        if not self.arguments.reload:
            return False
        logger.error("worker %d %s: waiting for a file to change", slot.index, why)
        async with anyio.create_task_group() as waiting:
            for event in (self.stopping, slot.restart_now):
                waiting.start_soon(_cancel_on, event, waiting.cancel_scope)
        slot.restart_now = anyio.Event()
        return not self.stopping.is_set()

    async def _run_one(self, slot: _Slot) -> int:
        """Start a worker in ``slot`` and wait for it to exit; return its status."""
        admin_fd = self.admin_fd if slot.index == 0 else None
        argv = self.argv(slot.index, admin_fd)
        process = await anyio.open_process(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=None,
            stderr=None,
            start_new_session=True,
            pass_fds=(admin_fd,) if admin_fd is not None else (),
        )
        slot.process = process
        slot.restart_now = anyio.Event()
        logger.info("worker %d started (pid %d)", slot.index, process.pid)
        if self.stopping.is_set():  # the stop was passed on while it started
            slot.signal(signal.SIGTERM)
        async with anyio.create_task_group() as watching:
            watching.start_soon(self._kill_when_late, slot, process)
            code = await process.wait()
            watching.cancel_scope.cancel()
        if code in (-signal.SIGTERM, -signal.SIGINT) and self.stopping.is_set():
            # Stopped before its handlers were set: it had started nothing.
            return Exit.OK
        return code

    async def _kill_when_late(self, slot: _Slot, process: Process) -> None:
        await self.stopping.wait()
        await anyio.sleep(self.arguments.graceful_timeout + _KILL_AFTER)
        if process.returncode is None:
            logger.error(
                "worker %d (pid %d) did not stop within %gs: killing it",
                slot.index,
                process.pid,
                self.arguments.graceful_timeout + _KILL_AFTER,
            )
            process.kill()

    # -- reload -----------------------------------------------------------------

    async def _watch_files(self) -> None:
        from .reload import changes

        paths = self.arguments.reload_dir or [self.arguments.app_dir]
        async for changed in changes(paths, self.stopping):
            logger.warning("%s changed: restarting the workers", changed)
            self.crashes.clear()
            for slot in self.slots:
                slot.failures = 0
                slot.restart_now.set()
                if slot.process is not None and slot.process.returncode is None:
                    slot.reloading = True
                    slot.signal(signal.SIGTERM)


def supervise(arguments: argparse.Namespace, child_argv: Callable[..., list[str]]) -> int:
    """Run ``arguments.workers`` workers (and the reloader) until stopped.

    :param child_argv: the command line of a worker, from ``arguments`` and the
        keywords ``index``, ``supervisor`` (pid) and ``admin_fd``.
    """
    if arguments.reload:
        from .reload import check_available

        check_available()
    supervisor = Supervisor(
        arguments,
        lambda index, admin_fd: child_argv(
            arguments, index=index, supervisor=os.getpid(), admin_fd=admin_fd
        ),
    )
    listener = None
    if arguments.admin is not None:
        from .admin import listen

        listener = listen(arguments.admin)
        supervisor.admin_fd = listener.fileno()
    try:
        logger.info(
            "supervisor (pid %d) runs %d worker(s) of %s%s",
            os.getpid(),
            arguments.workers,
            arguments.target,
            ", reloading on changes" if arguments.reload else "",
        )
        code: int = anyio.run(supervisor.run, backend="asyncio")
        return code
    finally:
        if listener is not None:
            listener.close()
