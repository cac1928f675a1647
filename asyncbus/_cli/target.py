"""What ``module:attribute`` names: a bus, a factory of one, or an ASGI app that runs one.

:func:`load` imports the object (the one step that runs the user's module);
:func:`running_bus` turns it into a running :class:`~asyncbus.Bus`:

* a ``Bus``: ``async with bus``;
* a factory, any callable taking no argument, sync or async: called once, in the
  event loop; it returns a bus (or an app, taken as below);
* an ASGI app (Starlette, FastAPI, or one wrapped in ASGI middleware), a callable of
  ``(scope, receive, send)``: its lifespan runs, as a server would run it, and the bus
  is the one that :func:`asyncbus.integrations.starlette.lifespan` stored on the app's
  state. Its HTTP routes are not served: that is a web server's job.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from .._bus import Bus
from . import CommandError
from .asgi import lifespan_of

__all__ = ["import_object", "kind_of", "load", "running_bus"]

Kind = Literal["bus", "factory", "app"]

#: What the command can run, for error messages.
_EXPECTED = "a Bus, a factory that returns one, or an ASGI app whose lifespan runs one"
#: How deep ``.app`` attributes are followed to find a wrapped app's ``state``.
_MAX_WRAPPERS = 16


def load(spec: str, app_dir: str | None = None) -> object:
    """Import ``module:attribute``: a bus, a factory of one or an app (see the module).

    :param app_dir: a directory put first on ``sys.path`` (the module's home).
    :raises CommandError: as :func:`import_object`, and for anything that cannot run.
    """
    value = import_object(spec, app_dir)
    kind_of(value, spec)  # refuse what cannot run before anything starts
    return value


def import_object(spec: str, app_dir: str | None = None) -> object:
    """Import ``module:attribute`` (``attribute`` may be dotted) and return the object.

    The current directory is searched first, as ``python -m`` does.

    :param app_dir: a directory put first on ``sys.path`` (the module's home).
    :raises CommandError: when ``spec`` is malformed, the module cannot be found or
        raises while it is imported, or has no such attribute.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise CommandError(
            f"{spec!r} is not module:attribute (for example 'shop.workers:bus', "
            "with shop/workers.py defining bus = Bus(...))"
        )
    if app_dir is not None:
        home = str(Path(app_dir).resolve())
        if home not in sys.path:
            sys.path.insert(0, home)
    elif os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # (the console script's path starts elsewhere)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name == missing or module_name.startswith(f"{missing}."):
            raise CommandError(
                f"cannot import {module_name!r}: {error} (searched {sys.path[0]!r} first: "
                "run from the directory that holds it, or pass --app-dir)"
            ) from None
        raise CommandError(f"importing {module_name!r} failed: {error}", cause=error) from None
    except Exception as error:
        raise CommandError(
            f"importing {module_name!r} raised {type(error).__name__}: {error}", cause=error
        ) from None
    value: object = module
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise CommandError(f"module {module_name!r} has no attribute {attribute!r}") from None
    return value


def kind_of(value: object, spec: str) -> Kind:
    """Whether ``value`` is a bus, a factory (no argument) or an ASGI app (three).

    :raises CommandError: for anything else.
    """
    if isinstance(value, Bus):
        return "bus"
    if not callable(value):
        raise CommandError(f"{spec} is {_describe(value)}, not {_EXPECTED}")
    try:
        parameters = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: try calling it
        return "factory"
    positional = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    variadic = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if len(positional) == 3 or (variadic and len(positional) < 3):
        return "app"
    if not positional:
        return "factory"
    raise CommandError(
        f"{spec} takes {len(positional)} argument(s): a factory takes none, an ASGI app "
        f"three (scope, receive, send); expected {_EXPECTED}"
    )


def _describe(value: object) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__} {value!r:.60}"


@contextlib.asynccontextmanager
async def running_bus(value: object, spec: str) -> AsyncIterator[Bus]:
    """Run what ``value`` is (see the module docstring) and yield its running bus.

    On exit the bus is closed (if the caller did not close it first) and an app's
    lifespan shut down. If the bus stops by itself, the body is interrupted and the
    exit raises what stopped it.

    :raises CommandError: when a factory returns something else than a bus or an app,
        or an app's lifespan runs no bus.
    """
    kind = kind_of(value, spec)
    if kind == "factory":
        assert callable(value)
        value = value()
        if inspect.isawaitable(value):
            value = await value
        kind = kind_of(value, f"what {spec}() returned")
        if kind == "factory":
            raise CommandError(f"{spec}() returned {_describe(value)}, not {_EXPECTED}")
    if isinstance(value, Bus):
        async with value:
            yield value
        return
    async with lifespan_of(value) as state:
        yield _bus_of_app(value, state, spec)


def _bus_of_app(app: Any, state: dict[str, Any], spec: str) -> Bus:
    """The bus that ``lifespan(bus)`` stored on the app's state (or the lifespan state)."""
    from ..integrations.starlette import _STATE_ATTRIBUTE

    holder = app
    for _ in range(_MAX_WRAPPERS):  # an app wrapped in ASGI middleware: app.app.app...
        if holder is None:
            break
        bus = getattr(getattr(holder, "state", None), _STATE_ATTRIBUTE, None)
        if isinstance(bus, Bus):
            return bus
        holder = getattr(holder, "app", None)
    bus = state.get(_STATE_ATTRIBUTE)
    if isinstance(bus, Bus):
        return bus
    raise CommandError(
        f"the lifespan of the app {spec} runs no bus: give the app "
        "lifespan=asyncbus.integrations.starlette.lifespan(bus) (or enter "
        "lifespan(bus)(app) in your own lifespan), or name the bus itself: module:bus"
    )
