"""``BaseException`` from a handler, the same on every offload and every backend.

``KeyboardInterrupt`` and ``SystemExit`` are not handler failures: the bus stops at
once, the envelope being handled is listed as abandoned (never acked, never
dead-lettered), the body of ``async with bus`` is interrupted and its exit raises the
exception itself. ``GeneratorExit`` is a failure like any exception: retried, then
dead-lettered ``handler_failed``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncbus import Adaptive, Bus, DeadLetterReason, Envelope, Retry

pytestmark = pytest.mark.anyio

_TESTS_DIR = str(Path(__file__).resolve().parents[1])
if _TESTS_DIR not in sys.path:
    sys.path.append(_TESTS_DIR)
process_handlers = importlib.import_module("_process_handlers")

_carried: ContextVar[str] = ContextVar("carried", default="")


async def raise_async(name: str) -> None:
    """An async handler raising the built-in exception called ``name``."""
    process_handlers.raise_named(name)


def subscribe(bus: Bus, offload: str, **options: Any) -> None:
    """Subscribe the raising handler on ``jobs`` (group ``g``) the way ``offload`` says."""
    if offload == "async":
        bus.subscribe("jobs", raise_async, group="g", **options)
    else:
        bus.subscribe("jobs", process_handlers.raise_named, group="g", offload=offload, **options)


OFFLOADS = ["async", "thread", "inline", "process"]


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
async def test_keyboard_interrupt_and_system_exit_stop_the_bus_and_propagate(
    offload: str, error: type[BaseException], assert_settled: Callable[[Bus], None]
) -> None:
    bus = Bus(workers=1)
    subscribe(bus, offload)
    sent: list[str] = []

    with anyio.fail_after(30):
        with pytest.raises(error) as raised:
            async with bus:
                receipt = await bus.publish("jobs", error.__name__)
                sent.append(receipt.id)
                await anyio.sleep_forever()  # interrupted: the exit raises it

    assert type(raised.value) is error  # itself, not in an exception group
    assert not bus.running
    report = await bus.aclose()
    assert (report.drained, report.published, report.completed, report.dead_lettered) == (
        False,
        1,
        0,
        0,
    )
    assert report.abandoned == sent
    assert len(bus.dead_letters) == 0
    assert_settled(bus)


@pytest.mark.parametrize(
    "variant", ["adaptive", "instrumented", "retry_on_base"], ids=lambda v: str(v)
)
async def test_keyboard_interrupt_stops_the_bus_whatever_the_stage(
    variant: str, assert_settled: Callable[[Bus], None]
) -> None:
    options: dict[str, Any] = {}
    bus = Bus(propagate_contextvars=[_carried] if variant == "instrumented" else ())
    if variant == "adaptive":
        options["concurrency"] = Adaptive(min=1, max=2)
    if variant == "retry_on_base":
        options["retry"] = Retry(max_attempts=3, backoff=0, retry_on=(BaseException,))
    subscribe(bus, "async", **options)

    with anyio.fail_after(10):
        with pytest.raises(KeyboardInterrupt):
            async with bus:
                receipt = await bus.publish("jobs", "KeyboardInterrupt")
                await anyio.sleep_forever()

    report = await bus.aclose()
    assert report.abandoned == [receipt.id]
    stats = bus.statistics()
    assert (stats.failed, stats.retried, stats.dead_lettered) == (0, 0, 0)
    assert_settled(bus)


async def test_an_aclose_waiting_in_another_task_gets_the_keyboard_interrupt() -> None:
    entered = anyio.Event()
    release = anyio.Event()
    bus = Bus()

    @bus.subscribe("jobs", group="g")
    async def handle(_: object) -> None:
        entered.set()
        await release.wait()
        raise KeyboardInterrupt

    told: list[BaseException] = []

    async def close_it() -> None:
        try:
            await bus.aclose(timeout=20)
        except KeyboardInterrupt as error:
            told.append(error)

    with anyio.fail_after(10):
        with pytest.raises(KeyboardInterrupt):
            async with bus:
                await bus.publish("jobs", 1)
                await entered.wait()
                async with anyio.create_task_group() as closing:
                    closing.start_soon(close_it)
                    await anyio.wait_all_tasks_blocked()
                    release.set()
                assert len(told) == 1  # the waiting aclose raised it first
                await anyio.sleep_forever()


@pytest.mark.parametrize("offload", OFFLOADS)
async def test_generator_exit_from_a_handler_is_a_failure(
    offload: str, assert_settled: Callable[[Bus], None]
) -> None:
    bus = Bus(workers=1)
    subscribe(bus, offload, retry=Retry(max_attempts=2, backoff=0, jitter=False))
    handled: list[str] = []

    @bus.subscribe("after", group="after")
    async def after(env: Envelope) -> None:
        handled.append(env.topic)

    with anyio.fail_after(30):
        async with bus:
            failed = await bus.publish("jobs", "GeneratorExit")
            await bus.drain()
            assert bus.running
            await bus.publish("after", None)  # the bus goes on
            await bus.drain()
            report = await bus.aclose(timeout=5)

    letter = bus.dead_letters.get(failed.id)
    assert letter is not None and letter.reason is DeadLetterReason.HANDLER_FAILED
    assert letter.attempts == 2
    assert letter.error == "HandlerExited: the handler raised GeneratorExit"
    assert bus.statistics().stage("jobs@g").retried == 1
    assert handled == ["after"]
    assert report.drained and report.abandoned == []
    assert_settled(bus)
