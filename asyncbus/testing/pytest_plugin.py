"""The asyncbus pytest plugin: a ``bus`` fixture for anyio and pytest-asyncio tests.

Installed with asyncbus and loaded by pytest through the ``pytest11`` entry point, so
there is nothing to configure. It adds fixtures only (none is autouse) and no hooks.

``bus`` is a running :class:`asyncbus.Bus` that is closed (drained) after the test.
Subscribe handlers on it inside the test: subscribing to a running bus takes
effect at once. It works in:

* anyio tests, ``@pytest.mark.anyio``, on every backend the test runs on
  (asyncio, uvloop, trio);
* pytest-asyncio tests, ``@pytest.mark.asyncio`` or ``asyncio_mode = "auto"``, in
  any loop scope.

Example::

    @pytest.mark.anyio
    async def test_audit(bus: Bus) -> None:
        seen = []
        bus.subscribe("orders.created", seen.append)
        await bus.publish("orders.created", {"id": 1})
        await bus.drain(timeout=5)
        assert seen == [{"id": 1}]

Override ``bus_options`` (a dict of keyword arguments for :class:`asyncbus.Bus`) in a
``conftest.py`` or test module to configure the bus, for example
``{"workers": 2, "middleware": [deduplicate()]}``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import pytest

from .._bus import Bus

__all__ = ["bus", "bus_options"]

#: pytest-asyncio's loop scopes; the asyncio flavour of the fixture exists once per scope
#: so that the bus always runs on the loop its test runs on.
_LOOP_SCOPES = ("function", "class", "module", "package", "session")

#: Seconds the fixture lets the bus drain after the test before abandoning what is left.
CLOSE_TIMEOUT = 10.0


@pytest.fixture
def bus_options() -> dict[str, Any]:
    """Keyword arguments for the :class:`~asyncbus.Bus` of the ``bus`` fixture (override it)."""
    return {}


@pytest.fixture
def bus(request: pytest.FixtureRequest) -> Bus:
    """A running :class:`~asyncbus.Bus`, drained and closed after the test.

    Works in anyio tests (``@pytest.mark.anyio``) and in pytest-asyncio tests
    (``@pytest.mark.asyncio`` or auto mode). A test that is neither fails with an
    explanation.
    """
    if "anyio_backend" in request.fixturenames:
        return cast(Bus, request.getfixturevalue("_asyncbus_anyio_bus"))
    scope = _asyncio_loop_scope(request)
    if scope is not None:
        return cast(Bus, request.getfixturevalue(f"_asyncbus_asyncio_bus_{scope}"))
    pytest.fail(
        "the `bus` fixture needs an async test run by an async plugin: mark it "
        "@pytest.mark.anyio (anyio's plugin) or @pytest.mark.asyncio (pytest-asyncio)",
        pytrace=False,
    )


def _asyncio_loop_scope(request: pytest.FixtureRequest) -> str | None:
    """The loop scope pytest-asyncio runs this test in, or None when it does not run it."""
    try:
        from pytest_asyncio import is_async_test
    except ImportError:
        return None
    item = request.node
    if not isinstance(item, pytest.Item) or not is_async_test(item):
        return None
    marker = item.get_closest_marker("asyncio")
    scope = None
    if marker is not None:
        scope = marker.kwargs.get("loop_scope") or marker.kwargs.get("scope")
    if scope is None:
        try:
            scope = request.config.getini("asyncio_default_test_loop_scope")
        except ValueError:  # a pytest-asyncio older than that option
            scope = None
    return str(scope or "function")


@pytest.fixture
async def _asyncbus_anyio_bus(bus_options: dict[str, Any]) -> AsyncIterator[Bus]:
    # anyio's plugin runs an async-generator fixture's setup and teardown in one task,
    # so the bus's task group can simply be entered around the yield.
    async with Bus(**bus_options) as running:
        yield running
        await running.aclose(timeout=CLOSE_TIMEOUT)


async def _asyncio_bus(bus_options: dict[str, Any]) -> AsyncIterator[Bus]:
    # pytest-asyncio runs setup and teardown as two separate tasks, and a task group
    # must be left by the task that entered it: so one task holds the bus open for
    # the whole test and is told when to close it.
    running = Bus(**bus_options)
    started = asyncio.Event()
    stop = asyncio.Event()

    async def hold() -> None:
        async with running:
            started.set()
            await stop.wait()
            await running.aclose(timeout=CLOSE_TIMEOUT)

    holder = asyncio.get_running_loop().create_task(hold(), name="asyncbus bus fixture")
    ready = asyncio.ensure_future(started.wait())
    await asyncio.wait((holder, ready), return_when=asyncio.FIRST_COMPLETED)
    if not started.is_set():
        ready.cancel()
        await holder  # raises what stopped the bus from starting
        raise RuntimeError("the bus fixture's bus stopped before it started")
    try:
        yield running
    finally:
        stop.set()
        await holder


def _register_asyncio_fixtures() -> dict[str, Callable[..., Any]]:
    try:
        import pytest_asyncio
    except ImportError:
        return {}
    fixtures: dict[str, Callable[..., Any]] = {}
    for scope in _LOOP_SCOPES:
        name = f"_asyncbus_asyncio_bus_{scope}"

        # pytest-asyncio marks the function object itself with its loop scope: one each.
        async def scoped(bus_options: dict[str, Any]) -> AsyncIterator[Bus]:
            async for running in _asyncio_bus(bus_options):
                yield running

        scoped.__name__ = scoped.__qualname__ = name
        fixtures[name] = pytest_asyncio.fixture(scoped, name=name, loop_scope=cast(Any, scope))
    return fixtures


globals().update(_register_asyncio_fixtures())
