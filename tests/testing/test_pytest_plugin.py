"""The pytest plugin's ``bus`` fixture, run in a fresh pytest for anyio and pytest-asyncio tests.

Each test writes a small test file and runs it with ``pytester`` in a subprocess, so the
plugin is loaded exactly as a user's project loads it: through the ``pytest11`` entry
point, next to anyio's and pytest-asyncio's plugins.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

pytest.importorskip("pytest_asyncio")

STRICT_INI = """
[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
filterwarnings = error
timeout = 30
"""

AUTO_INI = STRICT_INI.replace("asyncio_mode = strict", "asyncio_mode = auto")

ANYIO_TESTS = """
import anyio
import pytest

from asyncbus import Bus

pytestmark = pytest.mark.anyio
seen_buses = []


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


async def test_bus_is_running_and_delivers(bus: Bus, anyio_backend) -> None:
    assert isinstance(bus, Bus)
    assert bus.running
    received = []
    bus.subscribe("greetings", received.append)
    await bus.publish("greetings", "hello")
    await bus.drain(timeout=5)
    assert received == ["hello"]
    seen_buses.append(bus)


async def test_each_test_gets_a_new_bus(bus: Bus) -> None:
    assert all(bus is not earlier for earlier in seen_buses)
    seen_buses.append(bus)


async def test_work_left_at_the_end_is_drained(bus: Bus) -> None:
    async def slow(payload: int) -> None:
        await anyio.sleep(0.05)
        finished.append(payload)

    bus.subscribe("slow", slow, concurrency=2)
    for number in range(4):
        await bus.publish("slow", number)
    seen_buses.append(bus)


finished = []


async def test_a_test_may_close_the_bus_itself(bus: Bus) -> None:
    report = await bus.aclose(timeout=5)
    assert report.drained
    assert not bus.running


def test_every_bus_was_closed_after_its_test() -> None:
    assert len(seen_buses) == 6
    assert not any(bus.running for bus in seen_buses)
    assert sorted(finished) == [0, 0, 1, 1, 2, 2, 3, 3]
"""

ASYNCIO_STRICT_TESTS = """
import asyncio

import pytest

from asyncbus import Bus

seen_buses = []


@pytest.mark.asyncio
async def test_bus_is_running_and_delivers(bus: Bus) -> None:
    assert bus.running
    loops = []

    async def handler(payload: str) -> None:
        loops.append((payload, asyncio.get_running_loop()))

    bus.subscribe("greetings", handler)
    await bus.publish("greetings", "hello")
    await bus.drain(timeout=5)
    assert loops == [("hello", asyncio.get_running_loop())]
    seen_buses.append(bus)


@pytest.mark.asyncio
async def test_request_reply(bus: Bus) -> None:
    bus.subscribe("math.add", lambda numbers: numbers["a"] + numbers["b"])
    assert await bus.request("math.add", {"a": 1, "b": 2}, timeout=5) == 3
    seen_buses.append(bus)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_module_scoped_loop_gets_a_bus_on_that_loop(bus: Bus) -> None:
    bus.subscribe("ping", lambda payload: payload)
    assert await bus.request("ping", 1, timeout=5) == 1
    seen_buses.append(bus)


@pytest.mark.asyncio(loop_scope="module")
async def test_the_same_loop_again(bus: Bus) -> None:
    bus.subscribe("ping", lambda payload: payload)
    assert await bus.request("ping", 2, timeout=5) == 2
    seen_buses.append(bus)


@pytest.mark.asyncio
async def test_a_test_may_close_the_bus_itself(bus: Bus) -> None:
    report = await bus.aclose(timeout=5)
    assert report.drained
    assert not bus.running


class TestInAClass:
    @pytest.mark.asyncio(loop_scope="class")
    async def test_class_scoped_loop(self, bus: Bus) -> None:
        bus.subscribe("ping", lambda payload: payload)
        assert await bus.request("ping", 2, timeout=5) == 2
        seen_buses.append(bus)


def test_every_bus_was_closed_after_its_test() -> None:
    assert len(seen_buses) == 5
    assert len(set(map(id, seen_buses))) == 5
    assert not any(bus.running for bus in seen_buses)
"""

ASYNCIO_AUTO_TESTS = """
from asyncbus import Bus


async def test_no_marker_needed_in_auto_mode(bus: Bus) -> None:
    received = []
    bus.subscribe("greetings", received.append)
    await bus.publish("greetings", "hello")
    await bus.drain(timeout=5)
    assert received == ["hello"]
"""


def test_bus_fixture_in_anyio_tests(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makepyfile(test_anyio=ANYIO_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=9)


def test_bus_fixture_in_anyio_tests_without_pytest_asyncio(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI.replace("asyncio_", "# asyncio_"))
    pytester.makepyfile(test_anyio=ANYIO_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:asyncio")
    result.assert_outcomes(passed=9)


def test_bus_fixture_in_pytest_asyncio_strict_mode(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makepyfile(test_asyncio=ASYNCIO_STRICT_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=7)


def test_bus_fixture_in_pytest_asyncio_auto_mode(pytester: pytest.Pytester) -> None:
    pytester.makeini(AUTO_INI)
    pytester.makepyfile(test_auto=ASYNCIO_AUTO_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_anyio_and_pytest_asyncio_tests_share_one_session(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makepyfile(test_anyio=ANYIO_TESTS, test_asyncio=ASYNCIO_STRICT_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=16)


def test_bus_options_configure_the_fixture_bus(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makeconftest(
        """
        import pytest

        @pytest.fixture
        def bus_options():
            return {"name": "orders-service", "workers": 2}
        """
    )
    pytester.makepyfile(
        test_options="""
        import pytest

        @pytest.mark.anyio
        async def test_anyio(bus):
            assert (bus.name, bus.workers) == ("orders-service", 2)

        @pytest.mark.asyncio
        async def test_asyncio(bus):
            assert (bus.name, bus.workers) == ("orders-service", 2)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_bus_fixture_in_a_sync_test_fails_with_an_explanation(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makepyfile(
        test_sync="""
        def test_sync(bus):
            pass

        async def test_async_without_a_marker(bus):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore")
    result.assert_outcomes(errors=2)
    message = "*the `bus` fixture needs an async test*mark it @pytest.mark.anyio*"
    result.stdout.fnmatch_lines([message, message])


def test_plugin_adds_no_warnings_or_autouse_fixtures(pytester: pytest.Pytester) -> None:
    pytester.makeini(STRICT_INI)
    pytester.makepyfile(
        test_plain="""
        def test_plain(request):
            assert not any(name.startswith(("bus", "_asyncbus")) for name in request.fixturenames)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "asyncbus" in "\n".join(result.outlines)  # the header lists the plugin
    fixtures = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fixtures")
    fixtures.stdout.fnmatch_lines(["bus -- *", "*A running*Bus*drained and closed*"])
    fixtures.stdout.fnmatch_lines(["bus_options -- *"])
    fixtures.stdout.no_fnmatch_line("*_asyncbus*")
