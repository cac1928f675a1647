"""User middleware: the @middleware sugar, ordering, and a chain built once per stage."""

from typing import Any

import anyio
import pytest

from asyncbus import Bus, Envelope, Handler, Middleware, middleware

pytestmark = pytest.mark.anyio


def recording(name: str, calls: list[str]) -> Middleware:
    @middleware
    async def record(env: Envelope, call_next: Handler) -> Any:
        calls.append(f"{name}:before")
        result = await call_next(env)
        calls.append(f"{name}:after")
        return result

    return record


async def test_middleware_sugar_wraps_the_handler() -> None:
    calls: list[str] = []

    async def handle(payload: Any) -> None:
        calls.append(f"handler:{payload}")

    bus = Bus()
    bus.subscribe("t", handle, group="g", middleware=[recording("mw", calls)])
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()

    assert calls == ["mw:before", "handler:1", "mw:after"]


async def test_first_listed_is_outermost_and_bus_middleware_wraps_subscription_middleware() -> None:
    calls: list[str] = []

    async def handle(payload: Any) -> None:
        calls.append("handler")

    bus = Bus(middleware=[recording("bus1", calls), recording("bus2", calls)])
    bus.subscribe(
        "t",
        handle,
        group="g",
        middleware=[recording("sub1", calls), recording("sub2", calls)],
    )
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()

    assert calls == [
        "bus1:before",
        "bus2:before",
        "sub1:before",
        "sub2:before",
        "handler",
        "sub2:after",
        "sub1:after",
        "bus2:after",
        "bus1:after",
    ]


async def test_middleware_can_change_envelope_and_result() -> None:
    seen: list[Any] = []

    @middleware
    async def double_in_add_out(env: Envelope, call_next: Handler) -> Any:
        result = await call_next(env.evolve(payload=env.payload * 2))
        return result + 100

    async def handle(payload: int) -> int:
        seen.append(payload)
        return payload + 1

    bus = Bus()
    bus.subscribe("t", handle, group="g", middleware=[double_in_add_out])
    with anyio.fail_after(5):
        async with bus:
            # The reply is taken outside user middleware, so it sees the changed result.
            assert await bus.request("t", 5, timeout=5) == 111
            await bus.drain()

    assert seen == [10]


async def test_middleware_that_does_not_call_next_skips_the_handler_and_acks() -> None:
    handled: list[Any] = []

    @middleware
    async def swallow(env: Envelope, call_next: Handler) -> Any:
        return None

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus()
    bus.subscribe("t", handle, group="g", middleware=[swallow])
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1)
            await bus.drain()
            (stats,) = [s for s in bus.statistics().stages if s.name == "t@g"]
            assert (stats.published, stats.acked, stats.dead_lettered) == (1, 1, 0)

    assert handled == []


async def test_chain_is_built_once_per_stage_not_per_message() -> None:
    built: list[Handler] = []
    passed: list[Any] = []

    def counting(call_next: Handler) -> Handler:
        built.append(call_next)

        async def wrapped(env: Envelope) -> Any:
            passed.append(env.payload)
            return await call_next(env)

        return wrapped

    async def handle_a(payload: Any) -> None:
        pass

    async def handle_b(payload: Any) -> None:
        pass

    bus = Bus(middleware=[counting])
    bus.subscribe("a", handle_a, group="ga", concurrency=3)
    bus.subscribe("b", handle_b, group="gb")
    with anyio.fail_after(5):
        async with bus:
            assert len(built) == 2  # once per stage, at start
            for i in range(5):
                await bus.publish("a", i)
            for i in range(3):
                await bus.publish("b", i)
            await bus.drain()
            assert len(built) == 2

    assert sorted(passed) == [0, 0, 1, 1, 2, 2, 3, 4]
