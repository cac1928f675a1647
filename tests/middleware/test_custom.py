"""User middleware: the @middleware sugar, ordering, a chain built once per stage, and
the built-in retry and dead-letter layers replaced by a user's own (middleware decide, the
consumer acts), written against public names only, with the ledger exact."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import anyio
import pytest

import asyncbus
from asyncbus import (
    AsyncbusError,
    Bus,
    ConfigurationError,
    DeadLetterNow,
    DeadLetterReason,
    Envelope,
    Handler,
    HandlerError,
    HandlerTimeout,
    Middleware,
    Reject,
    RetryAfter,
    Skip,
    Verdict,
    middleware,
)

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


def my_dead_letter() -> Middleware:
    """A user's outermost layer: every failure becomes its own dead letter."""

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except Reject as error:
                return DeadLetterNow(DeadLetterReason.REJECTED, f"mine: {error.reason}", error)
            except Exception as error:
                return DeadLetterNow(DeadLetterReason.HANDLER_FAILED, f"mine: {error}", error)

        return handle

    wrap.asyncbus_builtin = "dead_letter"  # type: ignore[attr-defined]  # takes its place
    return wrap


def my_retry(max_attempts: int) -> Middleware:
    """A user's retry: at once, up to ``max_attempts``; a rejection is never retried."""

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            try:
                return await call_next(envelope)
            except Reject:
                raise
            except Exception as error:
                if envelope.attempt >= max_attempts:
                    raise
                return RetryAfter(0, error)

        return handle

    return wrap


def my_skip() -> Middleware:
    """Ack without handling what is marked ``skip``."""

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            if envelope.payload == "skip":
                return Skip()
            return await call_next(envelope)

        return handle

    return wrap


def test_this_module_imports_nothing_private_of_asyncbus() -> None:
    tree = ast.parse(pathlib.Path(__file__).read_text(encoding="utf-8"))
    private = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncbus"):
            private += [node.module] if "._" in f".{node.module}" else []
            private += [alias.name for alias in node.names if alias.name.startswith("_")]
        elif isinstance(node, ast.Import):
            private += [
                a.name for a in node.names if a.name.startswith("asyncbus") and "._" in a.name
            ]
    assert private == []


async def test_user_retry_and_dead_letter_replace_the_built_ins_with_an_exact_ledger() -> None:
    tries: dict[str, int] = {}
    handled: list[str] = []

    async def handle(payload: str) -> None:
        tries[payload] = tries.get(payload, 0) + 1
        if payload == "flaky" and tries[payload] < 3:
            raise RuntimeError("not yet")
        if payload == "bad":
            raise RuntimeError("never")
        if payload == "reject":
            raise Reject("no thanks")
        handled.append(payload)

    bus = Bus(middleware=[my_dead_letter()])
    bus.subscribe("jobs", handle, group="g", middleware=[my_retry(3), my_skip()])
    with anyio.fail_after(10):
        async with bus:
            for payload in ("ok", "flaky", "bad", "reject", "skip"):
                await bus.publish("jobs", payload)
            await bus.drain()
            stats = bus.statistics().stages[0]
            dead = {entry.envelope.payload: entry for entry in bus.dead_letters.list()}

    assert sorted(handled) == ["flaky", "ok"]
    assert tries == {"ok": 1, "flaky": 3, "bad": 3, "reject": 1}
    assert (stats.published, stats.acked, stats.dead_lettered, stats.abandoned) == (5, 3, 2, 0)
    assert (stats.depth, stats.in_flight) == (0, 0)
    # flaky failed twice, bad three times, reject once; flaky and bad were retried twice each.
    assert (stats.failed, stats.retried, stats.rejected) == (6, 4, 0)
    assert sorted(dead) == ["bad", "reject"]
    assert (dead["bad"].reason, dead["bad"].error, dead["bad"].attempts) == (
        DeadLetterReason.HANDLER_FAILED,
        "mine: never",
        3,
    )
    assert (dead["reject"].reason, dead["reject"].error, dead["reject"].attempts) == (
        DeadLetterReason.REJECTED,
        "mine: no thanks",
        1,
    )


async def test_a_verdict_is_not_forwarded_and_fails_a_request() -> None:
    seen: list[Any] = []

    async def first(payload: int) -> int:
        return payload + 1

    async def last(payload: int) -> int:
        seen.append(payload)
        return payload

    def kill_odd() -> Middleware:
        def wrap(call_next: Handler) -> Handler:
            async def handle(envelope: Envelope) -> Any:
                if envelope.payload % 2:
                    return DeadLetterNow("rejected", "odd")
                return await call_next(envelope)

            return handle

        return wrap

    bus = Bus()
    bus.subscribe("first", first, group="g", middleware=[kill_odd()])
    bus.subscribe("last", last, group="g")
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("first", 2, slip=["last"])
            await bus.publish("first", 3, slip=["last"])
            with pytest.raises(HandlerError) as caught:
                await bus.request("first", 5, slip=["last"])
            await bus.drain()
            stats = {stage.name: stage for stage in bus.statistics().stages}

    assert seen == [3]
    assert caught.value.stage == "first@g" and "odd" in str(caught.value)
    assert (stats["first@g"].acked, stats["first@g"].dead_lettered, stats["first@g"].failed) == (
        1,
        2,
        0,  # no exception: a verdict without a cause is not a failed attempt
    )


async def test_the_built_ins_give_verdicts_a_user_layer_outside_them_sees() -> None:
    results: list[Any] = []

    def outermost() -> Middleware:
        def wrap(call_next: Handler) -> Handler:
            async def handle(envelope: Envelope) -> Any:
                result = await call_next(envelope)
                results.append(result)
                return result

            return handle

        return wrap

    async def handle(payload: str) -> str:
        if payload == "boom":
            raise ValueError("boom")
        return payload

    bus = Bus()
    # Listed after the user's layer, the built-ins are placed inside it.
    retry = asyncbus.Retry(max_attempts=2, backoff=0)
    bus.subscribe(
        "t", handle, group="g", middleware=[outermost(), asyncbus.middleware.dead_letter(), retry]
    )
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", "fine")
            await bus.publish("t", "boom")
            await bus.drain()

    verdicts = [result for result in results if isinstance(result, Verdict)]
    assert "fine" in results
    assert [type(verdict) for verdict in verdicts] == [RetryAfter, DeadLetterNow]
    assert isinstance(verdicts[0], RetryAfter) and isinstance(verdicts[0].cause, ValueError)
    assert isinstance(verdicts[1], DeadLetterNow)
    assert (verdicts[1].reason, verdicts[1].error) == (
        DeadLetterReason.HANDLER_FAILED,
        "ValueError: boom",
    )

    async def never(envelope: Envelope) -> None:
        raise AssertionError("an expired envelope is not handled")

    expired = Envelope(topic="t", ttl=1.0, timestamp=0.0)
    verdict = await asyncbus.middleware.expire()(never)(expired)
    assert verdict == DeadLetterNow(DeadLetterReason.EXPIRED)


def test_verdicts_validate_what_they_are_given() -> None:
    with pytest.raises(ConfigurationError):
        RetryAfter(-1)
    with pytest.raises(ConfigurationError):
        RetryAfter(float("nan"))
    with pytest.raises(ConfigurationError):
        DeadLetterNow("no such reason")  # type: ignore[arg-type]
    assert DeadLetterNow("expired").reason is DeadLetterReason.EXPIRED  # type: ignore[arg-type]
    timed_out = HandlerTimeout("slow")
    assert DeadLetterNow.for_failure(timed_out) == DeadLetterNow(
        DeadLetterReason.TIMEOUT, "HandlerTimeout: slow", timed_out
    )
    assert DeadLetterNow.for_failure(Reject("no")).error == "Reject: no"


def test_handler_timeout_is_in_the_error_tree_and_exported_twice() -> None:
    assert issubclass(HandlerTimeout, AsyncbusError) and issubclass(HandlerTimeout, TimeoutError)
    assert asyncbus.middleware.HandlerTimeout is HandlerTimeout
    for name in ("Verdict", "Skip", "RetryAfter", "DeadLetterNow"):
        assert getattr(asyncbus.middleware, name) is getattr(asyncbus, name)
        assert name in asyncbus.__all__ and name in asyncbus.middleware.__all__


def my_expire(seen: list[int]) -> Middleware:
    """A user's expiry layer, replacing the built-in: it looks at every envelope."""

    def wrap(call_next: Handler) -> Handler:
        async def handle(envelope: Envelope) -> Any:
            seen.append(envelope.payload)
            if envelope.payload < 0:
                return DeadLetterNow(DeadLetterReason.EXPIRED)
            return await call_next(envelope)

        return handle

    wrap.asyncbus_builtin = "expire"  # type: ignore[attr-defined]  # takes its place
    return wrap


async def test_a_user_layer_in_place_of_a_pass_through_built_in_sees_every_envelope() -> None:
    seen: list[int] = []
    handled: list[int] = []
    bus = Bus()

    @bus.subscribe("readings", group="meters", middleware=[my_expire(seen)])
    async def record(payload: int) -> None:
        handled.append(payload)

    with anyio.fail_after(5):
        async with bus:
            for n in (1, -2, 3):
                await bus.publish("readings", n)  # no ttl, no slip: nothing built-in to do
            await bus.drain()
            stage = bus.statistics().stage("readings@meters")
            assert (stage.acked, stage.dead_lettered) == (2, 1)
            assert [entry.reason for entry in bus.dead_letters.list()] == [DeadLetterReason.EXPIRED]
    assert (seen, handled) == ([1, -2, 3], [1, 3])
