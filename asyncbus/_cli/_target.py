"""``module:attribute``: how a command names the bus (or anything else) it works on."""

from __future__ import annotations

import importlib
import inspect
import os
import sys

from .._bus import Bus

__all__ = ["TargetError", "load", "load_bus"]


class TargetError(Exception):
    """A ``module:attribute`` that names nothing usable; the message says why."""


def load(target: str) -> object:
    """The object ``target`` names: ``package.module:name`` (``name`` may be dotted).

    The current directory is searched first, as ``python -m`` does.

    :raises TargetError: for a malformed target, a module that does not exist or an
        attribute it does not have (an error raised by the module's own code while it
        is imported propagates as it is).
    """
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise TargetError(f"expected 'module:attribute' (such as 'myapp:bus'), got {target!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        found: object = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not f"{module_name}.".startswith(f"{error.name}."):
            raise  # the module itself imports something missing
        raise TargetError(f"no module named {error.name!r} (in {target!r})") from None
    for part in attribute.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise TargetError(f"{target!r}: {module_name} has no attribute {attribute!r}") from None
    return found


def load_bus(target: str) -> Bus:
    """The :class:`Bus` ``target`` names, or the one a function it names returns.

    :raises TargetError: as :func:`load`, and when it names something else.
    """
    found = load(target)
    if inspect.isroutine(found):
        found = found()  # a factory
    if not isinstance(found, Bus):
        raise TargetError(f"{target!r} is a {type(found).__qualname__}, not an asyncbus Bus")
    return found
