"""The suite's shared fixtures, and its one backend policy: every anyio test runs on
asyncio, asyncio with uvloop, and trio, unless its module or folder says otherwise."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import pytest
import sniffio

from asyncbus import Bus

T = TypeVar("T")

# The helpers beside this file (``_turns``, ``_spans``...) are imported by name from
# every test directory: pytest's importlib mode puts none of them on sys.path itself.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

import _steps  # noqa: E402  (beside this file: on sys.path from the line above)

_tally = _steps.StepTally()


#: The anyio backends a test can run on, by name: (backend, options) for anyio.
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
#: A trio run on a ``MockClock`` that jumps to the next deadline at once: hours of the
#: bus's timers in milliseconds. Each test gets a clock of its own.
MOCK_CLOCK = "trio-mock-clock"
#: Where a test module does not say: every backend, but in the folders whose tests
#: talk to brokers or drive subprocesses, whose clients are asyncio libraries.
_FOLDER_BACKENDS = {"transports": ("asyncio",), "cli": ("asyncio",)}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "backends(*names): the anyio backends a test runs on (asyncio, uvloop, trio, "
        f"{MOCK_CLOCK}); by default all three, asyncio alone under tests/transports and "
        "tests/cli",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow steps (``chaos``, ``browser``, ``readme``) run last, each as a block."""
    _steps.order(items)
    _tally.remember(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _tally.count(report)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    lines = _tally.lines()
    if len(lines) > 1:  # (one step alone says nothing the usual summary does not)
        terminalreporter.section("steps")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The one backend policy: every anyio test runs on the backends its module names
    with ``pytest.mark.backends(...)``, else on its folder's default."""
    if "anyio_backend" not in metafunc.fixturenames or "anyio_backend" in vars(metafunc.module):
        return  # (a module with a fixture of its own, as a user of the pytest plugin writes)
    for given in metafunc.definition.iter_markers("parametrize"):
        if "anyio_backend" in given.args[0]:
            return  # a test that brings its own loops (a skewed clock, say)
    marker = metafunc.definition.get_closest_marker("backends")
    if marker is not None:
        names: tuple[str, ...] = marker.args
    else:
        folder = metafunc.definition.path.relative_to(Path(_HERE)).parts[0]
        names = _FOLDER_BACKENDS.get(folder, tuple(BACKENDS))
    params = []
    for name in names:
        if name == "uvloop" and importlib.util.find_spec("uvloop") is None:
            skip = pytest.mark.skip(reason="uvloop is not installed")
            params.append(pytest.param(name, id=name, marks=skip))
        else:
            params.append(pytest.param(name, id=name))
    # A mock clock is the test's own; the others are shared by a module's tests.
    scope = "function" if MOCK_CLOCK in names else "module"
    metafunc.parametrize("anyio_backend", params, indirect=True, scope=scope)


@pytest.fixture(scope="module")
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The anyio backend (name, options) a test runs on; see :func:`pytest_generate_tests`."""
    name: str = getattr(request, "param", "asyncio")
    if name == MOCK_CLOCK:
        import trio.testing

        return ("trio", {"clock": trio.testing.MockClock(autojump_threshold=0)})
    return BACKENDS[name]


def _require_service(name: str, port: int) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
    except OSError as error:
        message = f"{name} not reachable on 127.0.0.1:{port} ({error})"
        if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; ASYNCBUS_REQUIRE_SERVICES=1 requires it", pytrace=False)
        pytest.skip(message)


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the local Redis server (skips when it is down; CI: fails)."""
    _require_service("Redis", 6379)
    return REDIS_URL


POSTGRES_DSN = "postgresql://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def postgres_dsn() -> str:
    """DSN of the local PostgreSQL server's ``test`` database (skips when it is down; CI:
    fails)."""
    _require_service("PostgreSQL", 5432)
    return POSTGRES_DSN


@pytest.fixture(scope="session")
def postgres_url(postgres_dsn: str) -> str:
    """``postgres_dsn`` without TLS (the broker table's URL: see there), under the name
    the broker table's tests look for."""
    return f"{postgres_dsn}?sslmode=disable"


@pytest.fixture
def unique_prefix() -> str:
    """A broker-name prefix unique to one test, so tests never see each other's data."""
    return f"asyncbus-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def redis_prefix(redis_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``; every Redis key under it is deleted after the test."""
    yield unique_prefix
    import redis.asyncio as aioredis

    with anyio.CancelScope(shield=True):
        client = aioredis.Redis.from_url(redis_url)
        try:
            keys = [key async for key in client.scan_iter(match=f"{unique_prefix}:*")]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()


@pytest.fixture
def require_service() -> Callable[[str, int], None]:
    """``require_service(name, port)``: skip unless 127.0.0.1:port answers (CI: fail)."""
    return _require_service


def _assert_settled(bus: Bus) -> None:
    for stage in bus.statistics().stages:
        ends = stage.acked + stage.dead_lettered + stage.abandoned
        assert (stage.name, stage.published, stage.depth, stage.in_flight) == (
            stage.name,
            ends,
            0,
            0,
        ), stage


@pytest.fixture
def assert_settled() -> Callable[[Bus], None]:
    """A check that every stage of a stopped bus balances exactly.

    ``published == acked + dead_lettered + abandoned`` per stage, nothing queued and
    nothing in flight.
    """
    return _assert_settled


@pytest.fixture
def run_in_own_loop(
    anyio_backend: tuple[str, dict[str, Any]],
) -> Callable[[Callable[[], Awaitable[T]], float], T]:
    """Run ``main()`` on the test's backend in a thread of its own, for at most ``seconds``.

    For a test of a deadlock that no cancel scope can break (a shielded wait): if
    ``main`` is still running after ``seconds`` the test fails, and the stuck event
    loop is left behind on its daemon thread instead of hanging the suite.
    """
    name, options = anyio_backend

    def run(main: Callable[[], Awaitable[T]], seconds: float) -> T:
        outcome: list[Any] = []

        def target() -> None:
            try:
                outcome.append(("ok", anyio.run(main, backend=name, backend_options=options)))
            except BaseException as error:  # handed to the test's thread below
                outcome.append(("error", error))

        thread = threading.Thread(target=target, name="run_in_own_loop", daemon=True)
        thread.start()
        thread.join(seconds)
        if thread.is_alive():
            pytest.fail(f"deadlocked: still running after {seconds} s")
        kind, value = outcome[0]
        if kind == "error":
            raise value
        return value  # type: ignore[no-any-return]

    return run


async def _cancelled_elsewhere() -> None:
    """Raise the backend's cancellation exception without the caller being cancelled.

    On asyncio: await a task that someone else cancelled (what the issue reproduced).
    On trio, where that cannot happen, a cancellation caught inside its own cancelled
    scope and raised again after the scope ended.
    """
    if sniffio.current_async_library() == "asyncio":
        import asyncio

        task = asyncio.get_running_loop().create_task(asyncio.sleep(10))
        await asyncio.sleep(0)
        task.cancel()
        await task
        return
    caught: BaseException | None = None
    with anyio.CancelScope() as scope:
        scope.cancel()
        try:
            await anyio.sleep(1)
        except anyio.get_cancelled_exc_class() as error:
            caught = error
    assert caught is not None
    raise caught


@pytest.fixture
def cancelled_elsewhere() -> Callable[[], Awaitable[None]]:
    """``await cancelled_elsewhere()`` raises a cancellation its caller did not get.

    What a handler meets when something it awaits was cancelled by someone else.
    """
    return _cancelled_elsewhere
