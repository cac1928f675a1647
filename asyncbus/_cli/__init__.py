"""The command line's building blocks: one module per command, shared exit codes.

``python -m asyncbus`` (``asyncbus/__main__.py``) holds the table of commands; each
command is a :class:`Command`: a help line, a function that adds its arguments to its
parser, and a function that runs it with the parsed arguments and returns the exit
status. A new command is one module here and one row in that table.
"""

from __future__ import annotations

import argparse
import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Command", "CommandError", "Exit", "int_in", "logger", "seconds"]

#: The command line's own records (the bus logs under its own loggers).
logger = logging.getLogger("asyncbus.cli")


class Exit(enum.IntEnum):
    """The exit statuses of ``python -m asyncbus run`` (and of its supervisor)."""

    #: Stopped by a signal and drained: nothing was abandoned.
    OK = 0
    #: Crashed: the bus could not start (a broker out of reach) or stopped by itself, a
    #: handler raised ``SystemExit``/``KeyboardInterrupt``, or (with ``--workers``) the
    #: supervisor gave up restarting workers that kept crashing.
    CRASHED = 1
    #: Could not run as asked: bad arguments, a target that cannot be imported or is not
    #: a bus, a factory of one or an app running one, a missing extra, a port in use, a
    #: configuration the bus refused. Restarting does not help.
    USAGE = 2
    #: Work abandoned: the drain did not finish within ``--graceful-timeout`` (or a
    #: second signal cut it short); the report lists what was cancelled.
    ABANDONED = 3


class CommandError(Exception):
    """A command cannot run as asked: one message for the operator, and the exit status.

    :param cause: an exception from the user's code worth its traceback in the log.
    """

    def __init__(
        self, message: str, *, code: Exit = Exit.USAGE, cause: BaseException | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.cause = cause

    def tell(self) -> int:
        """Log the message (with the cause's traceback, if any); return the exit status."""
        logger.error("asyncbus run: %s", self.message, exc_info=self.cause)
        return self.code


@dataclass(frozen=True, slots=True)
class Command:
    """One subcommand of ``python -m asyncbus``.

    :ivar help: the line ``--help`` shows for it.
    :ivar configure: adds the command's arguments to its parser.
    :ivar run: runs it with the parsed arguments and the ones left over (only a
        ``passthrough`` command gets any); returns the exit status.
    :ivar passthrough: arguments the parser does not know go to ``run`` (``bench``).
    """

    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, list[str]], int]
    passthrough: bool = False


def int_in(low: int, high: int | None) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high`` (no bound when ``None``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a finite number of seconds ``>= 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value
