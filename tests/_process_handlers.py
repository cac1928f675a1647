"""Handlers for ``offload="process"`` tests.

They live in a module of their own, importable by name, because a worker process
receives the handler pickled by reference (module and qualified name) and imports
it. ``test_offload.py`` puts this directory on ``sys.path`` before importing the
module; the worker process is given the parent's ``sys.path`` by anyio, so it can
import the module too (the tests run with ``--import-mode=importlib``, which puts
nothing on ``sys.path`` by itself).
"""

from __future__ import annotations

import os

from asyncbus import Envelope

__all__ = [
    "describe_envelope",
    "niceness",
    "raise_named",
    "square",
    "squares",
    "tag_with_pid",
]


def square(number: int) -> int:
    """Return ``number`` squared."""
    return number * number


def squares(numbers: list[int]) -> list[tuple[int, int]]:
    """A batch handler: each number squared, with the pid of the process that ran it."""
    return [(number * number, os.getpid()) for number in numbers]


def niceness(_: object) -> int:
    """Return the niceness of the process that ran it."""
    return os.nice(0)


def tag_with_pid(value: object) -> tuple[int, object]:
    """Return the id of the process that ran it, with ``value``."""
    return os.getpid(), value


def describe_envelope(env: Envelope) -> tuple[str, object, dict[str, str]]:
    """Return the topic, payload and headers of the envelope it was handed."""
    return env.topic, env.payload, dict(env.headers)


def raise_named(name: str) -> None:
    """Raise the built-in exception called ``name`` (``KeyboardInterrupt``, ...)."""
    raise {
        "KeyboardInterrupt": KeyboardInterrupt,
        "SystemExit": SystemExit,
        "GeneratorExit": GeneratorExit,
    }[name]()
