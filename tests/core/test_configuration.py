"""Configuration at the door: what cannot work fails where it is given, as ConfigurationError."""

from __future__ import annotations

import decimal
import fractions
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest

from asyncbus import (
    Adaptive,
    Admission,
    Bus,
    BusClosedError,
    ConfigurationError,
    DeadLetterReason,
    Envelope,
    Retry,
)
from asyncbus.middleware import deduplicate, timeout
from asyncbus.testing import capture

pytestmark = pytest.mark.anyio

#: Not a finite positive number of seconds, each for its own reason.
NOT_SECONDS = [math.nan, math.inf, -math.inf, -1.0, "1", True, None]
NOT_COUNTS = [math.nan, math.inf, 1.5, -1, "2", True, None]


async def handler(_: object) -> None:
    return None


# -- numbers --------------------------------------------------------------------------


@pytest.mark.parametrize("value", [*NOT_SECONDS, 0])
def test_bus_dead_letter_ttl_must_be_finite_and_positive(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="dead_letter_ttl"):
        Bus(dead_letter_ttl=value)


@pytest.mark.parametrize("value", NOT_COUNTS)
def test_bus_dead_letter_maxlen_must_be_an_int(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="dead_letter_maxlen"):
        Bus(dead_letter_maxlen=value)


@pytest.mark.parametrize("value", [0, *(v for v in NOT_COUNTS if v is not None)])
def test_bus_workers_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="workers"):
        Bus(workers=value)


def test_bus_name_must_be_a_string() -> None:
    with pytest.raises(ConfigurationError, match="name"):
        Bus(name=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [*(v for v in NOT_SECONDS if v is not None), 0])
def test_subscribe_timeout_must_be_finite_and_positive(value: Any) -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match="timeout"):
        bus.subscribe("jobs", handler, timeout=value)
    assert bus.statistics().stages == ()


@pytest.mark.parametrize("name", ["concurrency", "capacity"])
@pytest.mark.parametrize("value", [0, *(v for v in NOT_COUNTS if v is not None)])
def test_subscribe_concurrency_and_capacity_must_be_positive_ints(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Bus().subscribe("jobs", handler, **{name: value})


BAD_SUBSCRIBE_OPTIONS = [
    {"concurrency": -1},
    {"concurrency": 0},
    {"concurrency": 1.5},
    {"capacity": 0},
    {"capacity": True},
    {"timeout": math.nan},
    {"timeout": 0},
    {"timeout": "1"},
    {"backpressure": "sometimes"},
    {"retry": 3},
    {"offload": "gpu"},
    {"group": ""},
    {"group": 5},
    {"middleware": handler},
    {"middleware": [5]},
    {"admission": "yes"},
]


@pytest.mark.parametrize("options", BAD_SUBSCRIBE_OPTIONS, ids=lambda o: repr(o))
def test_the_decorator_form_refuses_bad_options_when_subscribe_is_called(
    options: dict[str, Any],
) -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError) as direct:
        bus.subscribe("jobs", handler, **options)
    with pytest.raises(ConfigurationError) as decorator:
        bus.subscribe("jobs", **options)  # not applied to anything yet
    assert str(decorator.value) == str(direct.value)
    assert bus.statistics().stages == ()


def test_the_decorator_form_refuses_joining_a_stage_with_other_options_at_once() -> None:
    bus = Bus()
    bus.subscribe("jobs", handler, group="g", capacity=5)
    with pytest.raises(ConfigurationError, match="capacity=5"):
        bus.subscribe("jobs", group="g", capacity=6)
    bus.subscribe("jobs", group="g", capacity=5)(handler)
    assert bus.statistics().stage("jobs@g").concurrency == 2


@pytest.mark.parametrize("name", ["backoff", "max_backoff"])
@pytest.mark.parametrize("value", [v for v in NOT_SECONDS if v is not None])
def test_retry_backoffs_must_be_finite_and_not_negative(name: str, value: Any) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Retry(**{name: value})


@pytest.mark.parametrize("value", [math.nan, math.inf, 0.5, 0, -2.0, "2", True])
def test_retry_multiplier_must_be_finite_and_at_least_one(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="multiplier"):
        Retry(multiplier=value)


@pytest.mark.parametrize("value", [0, 1.5, True, math.nan, "3"])
def test_retry_max_attempts_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_attempts"):
        Retry(max_attempts=value)


@pytest.mark.parametrize(
    "value", [(), ("ValueError",), (ValueError, 1), 1, ValueError(), (object,), object]
)
def test_retry_on_must_be_exception_classes(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="retry_on"):
        Retry(retry_on=value)


def test_retry_on_takes_one_class_a_tuple_or_a_list() -> None:
    assert Retry(retry_on=KeyError).retry_on == (KeyError,)
    assert Retry(retry_on=(KeyError, OSError)).retry_on == (KeyError, OSError)
    assert Retry(retry_on=[KeyError]).retry_on == (KeyError,)  # type: ignore[arg-type]


def test_retry_delay_follows_the_formula_and_caps_at_max_backoff() -> None:
    retry = Retry(backoff=0.1, multiplier=2.0, max_backoff=30.0, jitter=False)
    for attempt in range(1, 40):
        assert retry.delay(attempt) == min(0.1 * 2.0 ** (attempt - 1), 30.0)
    assert Retry(backoff=0, jitter=False).delay(5) == 0
    assert Retry(backoff=5, max_backoff=1, jitter=False).delay(1) == 1
    assert Retry(multiplier=1, backoff=0.5, jitter=False).delay(10**9) == 0.5


@pytest.mark.parametrize(
    ("options", "attempt"),
    [
        ({"multiplier": 2.0}, 2_000),
        ({"multiplier": 2.0}, 10**400),
        ({"multiplier": 1e308}, 3),
        ({"multiplier": 10, "backoff": 1e-300, "max_backoff": 1e300}, 10**9),
        ({"multiplier": 1.0000001, "max_backoff": 5.0}, 10**12),
    ],
)
def test_retry_delay_never_overflows(options: dict[str, Any], attempt: int) -> None:
    retry = Retry(jitter=False, **options)
    assert retry.delay(attempt) == retry.max_backoff
    jittered = Retry(jitter=True, **options).delay(attempt)
    assert retry.max_backoff / 2 <= jittered <= retry.max_backoff


@pytest.mark.parametrize("value", [*(v for v in NOT_SECONDS if v is not None), 0])
def test_deduplicate_window_must_be_finite_and_positive(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="window"):
        deduplicate(window=value)


@pytest.mark.parametrize("value", [0, 1.5, math.nan, True])
def test_deduplicate_maxlen_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="maxlen"):
        deduplicate(maxlen=value)


@pytest.mark.parametrize("value", [*(v for v in NOT_SECONDS if v is not None), 0])
def test_the_timeout_middleware_needs_finite_positive_seconds(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="seconds"):
        timeout(value)


#: Not finite real numbers, or not numbers: each refused by every numeric option.
NOT_FINITE_REALS = [
    10**400,
    -(10**400),
    math.nan,
    -math.inf,
    math.inf,
    True,
    False,
    "1",
    1j,
    decimal.Decimal("NaN"),
    decimal.Decimal("Infinity"),
    decimal.Decimal("1e400"),
    fractions.Fraction(10**400, 3),
]

#: Every public option that takes a number, as a call that raises at the door.
NUMERIC_OPTIONS: dict[str, Callable[[Any], object]] = {
    "Bus(dead_letter_ttl)": lambda v: Bus(dead_letter_ttl=v),
    "Bus(dead_letter_maxlen)": lambda v: Bus(dead_letter_maxlen=v),
    "Bus(workers)": lambda v: Bus(workers=v),
    "subscribe(timeout)": lambda v: Bus().subscribe("jobs", handler, timeout=v),
    "subscribe(capacity)": lambda v: Bus().subscribe("jobs", handler, capacity=v),
    "subscribe(concurrency)": lambda v: Bus().subscribe("jobs", handler, concurrency=v),
    "Retry(max_attempts)": lambda v: Retry(max_attempts=v),
    "Retry(backoff)": lambda v: Retry(backoff=v),
    "Retry(multiplier)": lambda v: Retry(multiplier=v),
    "Retry(max_backoff)": lambda v: Retry(max_backoff=v),
    "deduplicate(window)": lambda v: deduplicate(window=v),
    "deduplicate(lease)": lambda v: deduplicate(lease=v),
    "deduplicate(maxlen)": lambda v: deduplicate(maxlen=v),
    "timeout(seconds)": lambda v: timeout(v),
    "Adaptive(min)": lambda v: Adaptive(min=v),
    "Adaptive(max)": lambda v: Adaptive(max=v),
    "Adaptive(target_latency)": lambda v: Adaptive(target_latency=v),
    "Admission(target_wait)": lambda v: Admission(target_wait=v),
    "Admission(interval)": lambda v: Admission(interval=v),
}


@pytest.mark.parametrize("value", NOT_FINITE_REALS, ids=lambda v: repr(v)[:20])
@pytest.mark.parametrize("option", list(NUMERIC_OPTIONS))
def test_every_numeric_option_refuses_what_is_not_a_finite_number(option: str, value: Any) -> None:
    with pytest.raises(ConfigurationError):
        NUMERIC_OPTIONS[option](value)


@pytest.mark.parametrize("value", [decimal.Decimal("1.5"), fractions.Fraction(3, 2), 10**300])
def test_durations_take_any_finite_real_number_as_a_float(value: Any) -> None:
    assert Retry(backoff=value).backoff == float(value)
    assert Admission(target_wait=value).target_wait == float(value)
    assert Adaptive(target_latency=value).target_latency == float(value)
    assert Bus().subscribe("jobs", handler, timeout=value).timeout == float(value)


@pytest.mark.parametrize("value", NOT_FINITE_REALS, ids=lambda v: repr(v)[:20])
async def test_every_runtime_timeout_refuses_what_is_not_a_finite_number(value: Any) -> None:
    bus = Bus()
    bus.subscribe("jobs", handler, group="g")
    with anyio.fail_after(10):
        async with bus:
            with pytest.raises(ConfigurationError):
                await bus.publish("jobs", 1, timeout=value)
            with pytest.raises(ConfigurationError):
                await bus.publish("jobs", 1, ttl=value)
            with pytest.raises(ConfigurationError):
                bus.publish_nowait("jobs", 1, timeout=value)
            future = bus.publish_threadsafe("jobs", 1, timeout=value)
            assert isinstance(
                await anyio.to_thread.run_sync(lambda: future.exception(timeout=5)),
                ConfigurationError,
            )
            with pytest.raises(ConfigurationError):
                await bus.request("jobs", 1, timeout=value)
            with pytest.raises(ConfigurationError):
                await bus.drain(timeout=value)
            with pytest.raises(ConfigurationError):
                await bus.aclose(timeout=value)
            assert bus.running
            assert bus.statistics().published == 0


@pytest.fixture
async def running_bus() -> AsyncIterator[Bus]:
    bus = Bus()
    bus.subscribe("jobs", handler, group="g")
    with anyio.fail_after(10):
        async with bus:
            yield bus


@pytest.mark.parametrize("value", [*(v for v in NOT_SECONDS if v is not None), 0])
async def test_publish_ttl_must_be_finite_and_positive(running_bus: Bus, value: Any) -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        await running_bus.publish("jobs", 1, ttl=value)
    with pytest.raises(ConfigurationError, match="ttl"):
        running_bus.publish_nowait("jobs", 1, ttl=value)
    with pytest.raises(ConfigurationError, match="ttl"):
        await running_bus.request("jobs", 1, ttl=value)
    assert running_bus.statistics().published == 0


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, "1", True])
async def test_publish_and_request_timeouts_must_be_finite_and_not_negative(
    running_bus: Bus, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match="timeout"):
        await running_bus.publish("jobs", 1, timeout=value)
    with pytest.raises(ConfigurationError, match="timeout"):
        running_bus.publish_nowait("jobs", 1, timeout=value)
    with pytest.raises(ConfigurationError, match="timeout"):
        await running_bus.request("jobs", 1, timeout=value)
    assert running_bus.statistics().published == 0


async def test_capture_wait_for_refuses_a_nan_timeout(running_bus: Bus) -> None:
    with capture(running_bus) as captured, pytest.raises(ConfigurationError, match="timeout"):
        await captured.wait_for(1, timeout=math.nan)


# -- topics, slips, headers, ids ------------------------------------------------------


UNUSABLE_TOPICS = [["jobs"], {"jobs": 1}, {"jobs"}, 5, None, b"jobs", ""]


@pytest.mark.parametrize("topic", UNUSABLE_TOPICS, ids=repr)
async def test_a_topic_that_is_not_a_string_is_a_configuration_error(
    running_bus: Bus, topic: Any
) -> None:
    with pytest.raises(ConfigurationError, match="topic"):
        await running_bus.publish(topic, 1)
    with pytest.raises(ConfigurationError, match="topic"):
        running_bus.publish_nowait(topic, 1)
    with pytest.raises(ConfigurationError, match="topic"):
        await running_bus.request(topic, 1, timeout=1)
    future = running_bus.publish_threadsafe(topic, 1)
    await running_bus.drain()
    assert isinstance(future.exception(timeout=0), ConfigurationError)
    with pytest.raises(ConfigurationError):
        running_bus.subscribe(topic, handler)
    assert running_bus.statistics().published == 0


#: Patterns that could never match what a broker carries, and what the refusal says.
NEVER_MATCHING = {
    "orders.#": "write 'orders.>'",  # AMQP's habit
    "#.created": "write '*.created'",
    "orders created": "whitespace",
    "orders.\tcreated": "whitespace",
    "orders.\x00": "a control character",
    "orders..created": "empty token",
    ".orders": "empty token",
    "orders.": "empty token",
    "orders.>.created": "'>' may only be the last token",
    "orders.new*": "mixes a wildcard",
}
SYNTAX = "patterns use NATS syntax: tokens split on '.', '*' matches one token, '>' the rest"


@pytest.mark.parametrize(("pattern", "why"), NEVER_MATCHING.items(), ids=repr)
async def test_a_pattern_that_could_never_match_is_refused_saying_the_syntax(
    running_bus: Bus, pattern: str, why: str
) -> None:
    before = running_bus.statistics()
    for subscribe in (
        lambda: Bus().subscribe(pattern, handler),
        lambda: Bus().subscribe(pattern, group="g"),  # the decorator form fails at once too
        lambda: running_bus.subscribe(pattern, handler, group="late"),
    ):
        with pytest.raises(ConfigurationError) as caught:
            subscribe()
        message = str(caught.value)
        assert message.startswith(f"pattern {pattern!r}"), message
        assert why in message and SYNTAX in message
    assert running_bus.statistics() == before  # the running bus is left as it was
    assert running_bus.running


@pytest.mark.parametrize("topic", ["orders created", "orders.\ncreated", "orders\x7f", "\u2003"])
async def test_a_topic_with_whitespace_or_a_control_character_is_refused_on_publish(
    running_bus: Bus, topic: str
) -> None:
    with pytest.raises(ConfigurationError, match=r"whitespace|control character"):
        await running_bus.publish(topic, 1)
    with pytest.raises(ConfigurationError, match=r"whitespace|control character"):
        await running_bus.publish_many(topic, [1, 2])
    with pytest.raises(ConfigurationError, match=r"whitespace|control character"):
        running_bus.publish_nowait(topic, 1)
    future = running_bus.publish_threadsafe(topic, 1)
    await running_bus.drain()
    assert isinstance(future.exception(timeout=0), ConfigurationError)
    assert running_bus.statistics().published == 0
    assert len(running_bus.dead_letters) == 0  # not even a no_subscribers letter


async def test_topics_that_were_valid_stay_valid(assert_settled: Callable[[Bus], None]) -> None:
    got: list[str] = []
    bus = Bus()

    @bus.subscribe(">", group="all")
    async def everything(env: Envelope) -> None:
        got.append(env.topic)

    @bus.subscribe("$deadletter", group="watch")
    async def watch(_: object) -> None:
        pass

    topics = ["orders.#", "c#.news", "café.commande", "a-b_c:d/e", "$deadletter.x", "x" * 300]
    with anyio.fail_after(10):
        async with bus:
            for topic in topics:
                await bus.publish(topic, 1)
            await bus.drain()
    assert got == topics
    assert_settled(bus)


async def test_publishing_before_the_start_says_how_to_start_the_bus() -> None:
    """``async with bus`` for a script, ``lifespan=lifespan(bus)`` for a web app."""
    bus = Bus()
    bus.subscribe("jobs", handler, group="g")
    wanted = [
        "the bus has not started: publish inside `async with bus:`",
        "`lifespan=lifespan(bus)`",
    ]
    errors: list[BaseException] = []
    for attempt in (
        lambda: bus.publish("jobs", 1),
        lambda: bus.publish_many("jobs", [1]),
        lambda: bus.request("jobs", 1),
    ):
        with pytest.raises(BusClosedError) as caught:
            await attempt()
        errors.append(caught.value)
    with pytest.raises(BusClosedError) as caught:
        bus.publish_nowait("jobs", 1)
    errors.append(caught.value)
    error = bus.publish_threadsafe("jobs", 1).exception(timeout=5)
    assert error is not None
    errors.append(error)
    for error in errors:
        assert all(part in str(error) for part in wanted), error
    assert bus.statistics().published == 0


async def test_a_bare_string_slip_is_one_hop(assert_settled: Callable[[Bus], None]) -> None:
    sunk: list[Envelope] = []
    bus = Bus()

    @bus.subscribe("ingest", group="ingest")
    async def ingest(n: int) -> int:
        return n + 1

    @bus.subscribe("sink", group="sink")
    async def sink(env: Envelope) -> None:
        sunk.append(env)

    with anyio.fail_after(10):
        async with bus:
            with capture(bus) as captured:
                await bus.publish("ingest", 1, slip="sink")
                await bus.drain()
            assert await bus.request("ingest", 41, slip="ingest") == 43
            await bus.drain()

    assert [env.payload for env in sunk] == [2]
    assert [record.topic for record in captured] == ["ingest", "sink"]
    assert len(bus.dead_letters) == 0  # no hop went to "s", "i", "n" or "k"
    assert_settled(bus)


@pytest.mark.parametrize("slip", [5, ["sink", ["nested"]], ["sink", 5], ["sink", "a.*"]], ids=repr)
async def test_a_slip_that_is_not_topics_is_a_configuration_error(
    running_bus: Bus, slip: Any
) -> None:
    with pytest.raises(ConfigurationError):
        await running_bus.publish("jobs", 1, slip=slip)
    assert running_bus.statistics().published == 0


@pytest.mark.parametrize("headers", [{"k": 1}, {1: "v"}, ["k", "v"], "k=v"], ids=repr)
async def test_headers_must_map_strings_to_strings(running_bus: Bus, headers: Any) -> None:
    with pytest.raises(ConfigurationError, match="header"):
        await running_bus.publish("jobs", 1, headers=headers)
    assert running_bus.statistics().published == 0


@pytest.mark.parametrize("id", [5, ["x"], ""], ids=repr)
async def test_an_envelope_id_must_be_a_non_empty_string(running_bus: Bus, id: Any) -> None:
    with pytest.raises(ConfigurationError, match="id"):
        await running_bus.publish("jobs", 1, id=id)
    assert running_bus.statistics().published == 0


# -- handlers -------------------------------------------------------------------------


async def agen_handler(_: object) -> AsyncIterator[None]:
    yield None


def gen_handler(_: object) -> Iterator[None]:
    yield None


class AsyncGenCallable:
    async def __call__(self, _: object) -> AsyncIterator[None]:
        yield None


async def no_arguments() -> None:
    return None


async def two_arguments(a: object, b: object) -> None:
    return None


@pytest.mark.parametrize(
    "bad",
    [
        agen_handler,
        gen_handler,
        AsyncGenCallable(),
        functools.partial(agen_handler),
        no_arguments,
        two_arguments,
    ],
    ids=["async generator", "generator", "async generator __call__", "partial", "no args", "two"],
)
def test_what_cannot_be_a_handler_is_refused_at_subscribe(bad: Any) -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match=r"handler|generator"):
        bus.subscribe("jobs", bad)
    with pytest.raises(ConfigurationError, match=r"handler|generator"):
        bus.subscribe("jobs")(bad)
    assert bus.statistics().stages == ()


def passes_through(function: Callable[..., Any]) -> Callable[..., Any]:
    """A plain ``functools.wraps`` decorator: it returns what the function returns."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


class AsyncGenMethods:
    async def method(self, _: object) -> AsyncIterator[None]:
        yield None

    @staticmethod
    async def static(_: object) -> AsyncIterator[None]:
        yield None

    @classmethod
    async def klass(cls, _: object) -> AsyncIterator[None]:
        yield None


@pytest.mark.parametrize(
    "bad",
    [
        passes_through(agen_handler),
        passes_through(passes_through(agen_handler)),
        functools.partial(passes_through(agen_handler)),
        passes_through(functools.partial(agen_handler)),
        AsyncGenMethods().method,
        AsyncGenMethods.__dict__["static"],
        AsyncGenMethods.static,
        AsyncGenMethods.__dict__["klass"],
        AsyncGenMethods.klass,
        staticmethod(passes_through(agen_handler)),
    ],
    ids=[
        "wraps",
        "wraps twice",
        "partial of wraps",
        "wraps of partial",
        "bound method",
        "staticmethod object",
        "staticmethod",
        "classmethod object",
        "classmethod",
        "staticmethod of wraps",
    ],
)
def test_an_async_generator_function_behind_a_wrapper_is_refused_at_subscribe(bad: Any) -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match="generator"):
        bus.subscribe("jobs", bad, group="g")
    with pytest.raises(ConfigurationError, match="generator"):
        bus.subscribe("jobs", group="g")(bad)
    assert bus.statistics().stages == ()


def test_an_async_wrapper_of_an_async_generator_is_a_handler() -> None:
    @functools.wraps(agen_handler)
    async def consumes(payload: object) -> None:
        async for _ in agen_handler(payload):
            pass

    bus = Bus()
    bus.subscribe("jobs", consumes, group="a")
    bus.subscribe("jobs", staticmethod(handler), group="b")
    assert len(bus.statistics().stages) == 2


@pytest.mark.parametrize("offload", [None, "thread", "inline"])
@pytest.mark.parametrize("returned", ["async generator", "async iterator"])
async def test_a_sync_handler_returning_an_async_generator_is_dead_lettered_not_acked(
    offload: Any, returned: str, assert_settled: Callable[[Bus], None]
) -> None:
    ran: list[object] = []

    async def work(payload: object) -> AsyncIterator[object]:
        ran.append(payload)
        yield payload

    class Ticks:
        def __aiter__(self) -> Ticks:
            return self

        async def __anext__(self) -> object:
            ran.append("tick")
            raise StopAsyncIteration

    bus = Bus()
    if returned == "async generator":
        bus.subscribe("jobs", lambda payload: work(payload), group="g", offload=offload)
    else:
        bus.subscribe("jobs", lambda payload: Ticks(), group="g", offload=offload)
    with anyio.fail_after(10):
        async with bus:
            receipt = await bus.publish("jobs", 1)
            await bus.drain()

    assert ran == []
    letter = bus.dead_letters.get(receipt.id)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert letter.error is not None and f"returned an {returned}" in letter.error
    stats = bus.statistics().stage("jobs@g")
    assert (stats.acked, stats.dead_lettered) == (0, 1)
    assert_settled(bus)


def test_handlers_with_optional_extra_parameters_are_fine() -> None:
    async def extra(payload: object, flag: bool = False, *rest: object, **options: object) -> None:
        return None

    Bus().subscribe("jobs", extra)


def returns_the_coroutine(function: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Any]:
    """A decorator that hides an async function behind a plain one (it returns the coroutine)."""

    def wrapper(payload: Any) -> Any:
        return function(payload)

    return wrapper


@pytest.mark.parametrize("offload", [None, "thread", "inline"])
async def test_a_sync_handler_returning_a_coroutine_has_it_awaited_before_the_ack(
    offload: Any, assert_settled: Callable[[Bus], None]
) -> None:
    done: list[int] = []
    bus = Bus()

    @returns_the_coroutine
    async def work(n: int) -> int:
        await anyio.lowlevel.checkpoint()
        if n < 0:
            raise ValueError("negative")
        done.append(n)
        return n * 10

    bus.subscribe("jobs", work, group="g", offload=offload)
    with anyio.fail_after(10):
        async with bus:
            await bus.publish("jobs", 1)
            failed = await bus.publish("jobs", -1)
            assert await bus.request("jobs", 2) == 20
            await bus.drain()

    assert sorted(done) == [1, 2]
    letter = bus.dead_letters.get(failed.id)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert letter.error == "ValueError: negative"
    stats = bus.statistics().stage("jobs@g")
    assert (stats.published, stats.acked, stats.dead_lettered) == (3, 2, 1)
    assert_settled(bus)
