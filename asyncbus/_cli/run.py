"""``python -m asyncbus run module:bus``: run a bus as a worker process, or N of them.

One worker runs in this process (:mod:`.worker`); ``--workers N`` (N > 1) or
``--reload`` runs them as child processes under a supervisor (:mod:`.supervisor`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import sys
from collections.abc import Callable
from functools import partial
from types import FrameType
from typing import Any

from . import Command, CommandError, Exit, int_in, logger, seconds
from .logs import LEVELS, configure

__all__ = ["COMMAND", "child_argv"]


LOOPS = ("auto", "asyncio", "uvloop", "trio")
DEFAULT_GRACEFUL_TIMEOUT = 30.0

_DESCRIPTION = """\
Run the bus named by TARGET until SIGTERM or SIGINT, then drain it for up to
--graceful-timeout seconds, log its shutdown report and exit. A second signal stops
at once. TARGET is module:attribute, naming a Bus, a factory that returns one (sync or
async), or an ASGI app (Starlette, FastAPI) whose lifespan runs one (its lifespan runs;
its HTTP routes are not served).

exit status: 0 stopped and drained; 1 crashed (the bus could not start or stopped by
itself; with --workers, the supervisor gave up restarting); 2 could not run as asked
(bad arguments, a target that cannot be imported, a missing extra, a port in use);
3 work abandoned (the drain did not finish in time, or was cut short)."""


def _address(text: str) -> str:
    from .admin import parse_address

    try:
        parse_address(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``run``."""
    parser.description = _DESCRIPTION
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("target", metavar="TARGET", help="module:attribute, e.g. shop.worker:bus")
    parser.add_argument(
        "--workers",
        type=int_in(1, None),
        default=1,
        help="worker processes under a supervisor that restarts a crashed one (default 1: "
        "this process runs the bus)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=seconds,
        default=DEFAULT_GRACEFUL_TIMEOUT,
        metavar="S",
        help=f"seconds to drain after the first signal (default {DEFAULT_GRACEFUL_TIMEOUT:g})",
    )
    parser.add_argument(
        "--admin",
        type=_address,
        metavar="HOST:PORT",
        help="serve the admin app with /healthz and /readyz there (with --workers, worker 0 "
        "serves it); the token, if any, comes from $ASYNCBUS_ADMIN_TOKEN",
    )
    parser.add_argument(
        "--metrics", action="store_true", help="also serve /metrics on --admin (Prometheus)"
    )
    parser.add_argument(
        "--reload",
        action="store_true",
        help="restart the workers when a Python file changes (development; needs watchfiles)",
    )
    parser.add_argument(
        "--reload-dir",
        action="append",
        metavar="DIR",
        help="a directory --reload watches (repeatable; default: --app-dir)",
    )
    parser.add_argument(
        "--app-dir",
        default=".",
        metavar="DIR",
        help="the directory TARGET's module is imported from (default: the current one)",
    )
    parser.add_argument("--loop", choices=LOOPS, default="auto", help="auto: uvloop if installed")
    parser.add_argument("--log-level", choices=LEVELS, default="info")
    parser.add_argument("--log-format", choices=("text", "json"), default="text")
    parser.add_argument(
        "--max-restarts",
        type=int_in(0, None),
        default=5,
        metavar="N",
        help="with --workers: give up after more than N crashes within --restart-window",
    )
    parser.add_argument(
        "--restart-window",
        type=seconds,
        default=60.0,
        metavar="S",
        help="the window of --max-restarts, in seconds (default 60)",
    )
    # Set by the supervisor for its children only.
    for hidden in ("--worker-index", "--supervisor-pid", "--admin-fd"):
        parser.add_argument(hidden, type=int_in(0, None), help=argparse.SUPPRESS)


def child_argv(
    arguments: argparse.Namespace, *, index: int, supervisor: int, admin_fd: int | None
) -> list[str]:
    """The command line of worker ``index`` under the supervisor with pid ``supervisor``."""
    argv = [
        sys.executable,
        "-m",
        "asyncbus",
        "run",
        arguments.target,
        "--app-dir",
        os.path.abspath(arguments.app_dir),
        "--graceful-timeout",
        repr(arguments.graceful_timeout),
        "--loop",
        arguments.loop,
        "--log-level",
        arguments.log_level,
        "--log-format",
        arguments.log_format,
        "--worker-index",
        str(index),
        "--supervisor-pid",
        str(supervisor),
    ]
    if admin_fd is not None:
        argv += ["--admin-fd", str(admin_fd)]
        if arguments.metrics:
            argv.append("--metrics")
    return argv


def run(arguments: argparse.Namespace, rest: list[str]) -> int:
    """Run the ``run`` command; return its exit status (see :class:`Exit`)."""
    configure(arguments.log_level, arguments.log_format)
    try:
        _check(arguments)
        if arguments.workers > 1 or arguments.reload:
            from .supervisor import supervise

            return supervise(arguments, child_argv)
        return _run_alone(arguments)
    except CommandError as error:
        return error.tell()


def _check(arguments: argparse.Namespace) -> None:
    """Refuse early what cannot work: a missing loop or extra, options that do not mix."""
    if arguments.loop in ("uvloop", "trio") and importlib.util.find_spec(arguments.loop) is None:
        raise CommandError(f"--loop {arguments.loop} needs {arguments.loop}: pip install it")
    if arguments.metrics and arguments.admin is None and arguments.admin_fd is None:
        raise CommandError("--metrics is served on the admin port: add --admin HOST:PORT")
    if arguments.admin is not None or arguments.admin_fd is not None:
        from .admin import check_extras

        check_extras(arguments.loop)
    if arguments.reload_dir and not arguments.reload:
        raise CommandError("--reload-dir is for --reload")


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _EarlySignals:
    """SIGTERM/SIGINT before the event loop takes over: noted, so the bus never starts.

    A second SIGINT while the target is imported interrupts the import.
    """

    def __init__(self) -> None:
        self.arrived: str | None = None
        for number in _SIGNALS:
            signal.signal(number, self._note)

    def _note(self, number: int, frame: FrameType | None) -> None:
        if self.arrived is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.arrived = signal.Signals(number).name

    def take(self) -> str | None:
        return self.arrived


def _run_alone(arguments: argparse.Namespace) -> int:
    from .target import load
    from .worker import WorkerSettings, work

    early = _EarlySignals()
    listener = _admin_socket(arguments)
    try:
        target = load(arguments.target, arguments.app_dir)
    except KeyboardInterrupt:
        logger.info("interrupted while %s was imported: the bus never started", arguments.target)
        return Exit.OK
    settings = WorkerSettings(
        name=arguments.target,
        graceful_timeout=arguments.graceful_timeout,
        admin=listener,
        metrics=arguments.metrics,
        index=arguments.worker_index,
        supervisor=arguments.supervisor_pid,
    )
    return _on_loop(arguments.loop, partial(work, target, settings, early.take))


def _admin_socket(arguments: argparse.Namespace) -> socket.socket | None:
    if arguments.admin_fd is not None:
        return socket.socket(fileno=arguments.admin_fd)
    if arguments.admin is not None:
        from .admin import listen

        return listen(arguments.admin)
    return None


def _on_loop(loop: str, main: Callable[[], Any]) -> int:
    """Run ``main()`` on the chosen event loop; return what it returns."""
    import anyio

    if loop == "trio":
        backend, options = "trio", {}
    elif loop == "uvloop" or (loop == "auto" and importlib.util.find_spec("uvloop") is not None):
        backend, options = "asyncio", {"use_uvloop": True}
    else:
        backend, options = "asyncio", {}
    code: int = anyio.run(main, backend=backend, backend_options=options)
    return code


COMMAND = Command(
    help="run a bus as a worker: drains on SIGTERM/SIGINT, exits non-zero when work was abandoned",
    configure=configure_parser,
    run=run,
)
