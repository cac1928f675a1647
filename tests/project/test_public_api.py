"""The public surface exactly as documented: names importable from ``asyncbus``,
field orders, the ``middleware`` name, argument lists, default groups."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import subprocess
import sys
from typing import Any

import anyio
import pytest

import asyncbus
from asyncbus import Bus, BusStatistics, Envelope, ShutdownReport, StageStatistics

TRANSPORT_NAMES = (
    "Transport",
    "Delivery",
    "Capabilities",
    "MemoryTransport",
    "RedisTransport",
    "NatsTransport",
    "RabbitTransport",
    "Codec",
)


@pytest.mark.parametrize("name", TRANSPORT_NAMES)
def test_transport_names_import_from_asyncbus(name: str) -> None:
    transports = importlib.import_module("asyncbus.transports")
    assert getattr(asyncbus, name) is getattr(transports, name)
    assert name in asyncbus.__all__


def test_importing_asyncbus_loads_no_broker_client() -> None:
    code = (
        "import sys, asyncbus; from asyncbus import RedisTransport, NatsTransport, "
        "RabbitTransport; print(sorted(m for m in ('redis', 'nats', 'aiormq', 'aio_pika') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


def test_middleware_is_both_the_decorator_and_the_package_of_built_ins() -> None:
    package = importlib.import_module("asyncbus.middleware")
    assert asyncbus.middleware is package
    assert callable(package.deduplicate) and callable(package.retry.Retry)

    @asyncbus.middleware
    async def tag(env: Envelope, call_next: Any) -> Any:
        return await call_next(env)

    async def handler(env: Envelope) -> str:
        return "handled"

    wrapped = tag(handler)
    assert anyio.run(wrapped, Envelope(topic="t")) == "handled"


def test_stage_statistics_fields_in_design_order() -> None:
    design = [
        "name",
        "topic",
        "group",
        "published",
        "acked",
        "failed",
        "retried",
        "dead_lettered",
        "rejected",
        "dropped",
        "expired",
        "depth",
        "in_flight",
        "concurrency",
        "latency_p50",
        "latency_p99",
        "wait_p99",
    ]
    names = [field.name for field in dataclasses.fields(StageStatistics)]
    assert names[: len(design)] == design


DESIGN_STAGE_FIELDS: dict[str, object] = {
    "name": "jobs@g",
    "topic": "jobs",
    "group": "g",
    "published": 5,
    "acked": 3,
    "failed": 2,
    "retried": 1,
    "dead_lettered": 1,
    "rejected": 1,
    "dropped": 0,
    "expired": 0,
    "depth": 1,
    "in_flight": 0,
    "concurrency": 2,
    "latency_p50": 0.01,
    "latency_p99": 0.02,
    "wait_p99": 0.03,
}


def test_stage_statistics_can_be_made_with_the_design_fields_alone() -> None:
    by_name = StageStatistics(**DESIGN_STAGE_FIELDS)  # type: ignore[arg-type]
    by_position = StageStatistics(*DESIGN_STAGE_FIELDS.values())  # type: ignore[arg-type]
    assert by_name == by_position
    assert {name: getattr(by_name, name) for name in DESIGN_STAGE_FIELDS} == DESIGN_STAGE_FIELDS
    later = {
        field.name: getattr(by_name, field.name)
        for field in dataclasses.fields(StageStatistics)
        if field.name not in DESIGN_STAGE_FIELDS
    }
    assert later == {
        "abandoned": 0,
        "capacity": 0,
        "limit": 0,
        "shedding": False,
        "shed": 0,
        "saturation": 0.0,
        "deferred": 0,
        "ordering": None,
        "keys_held": 0,
        "keys_waiting": 0,
        "waiting_for_key": 0,
        "max_in_flight": None,
        "slots_held": 0,
        "slots_waiting": 0,
        "partitions": None,
        "partitions_owned": 0,
    }


def test_bus_statistics_can_be_made_without_the_later_totals() -> None:
    stats = BusStatistics(
        stages=(),
        published=0,
        acked=0,
        failed=0,
        retried=0,
        dead_lettered=0,
        rejected=0,
        dropped=0,
        expired=0,
    )
    assert (stats.abandoned, stats.depth, stats.in_flight, stats.dead_letter_queue) == (0, 0, 0, 0)
    assert stats.free_threaded is False


def test_shutdown_report_abandoned_is_a_list_of_ids() -> None:
    names = [field.name for field in dataclasses.fields(ShutdownReport)]
    assert names == [
        "drained",
        "published",
        "completed",
        "dead_lettered",
        "abandoned",
        "scheduled",
    ]

    async def main() -> ShutdownReport:
        bus = Bus()
        async with bus:
            pass
        return await bus.aclose()

    assert anyio.run(main).abandoned == []


def test_publish_nowait_takes_the_arguments_of_publish() -> None:
    async def main() -> tuple[str, ...]:
        bus = Bus()
        bus.subscribe("t", lambda payload: None, group="g", offload="inline")
        async with bus:
            receipt = bus.publish_nowait("t", 1, headers={"k": "v"}, ttl=5, timeout=1.0)
        return receipt.accepted

    assert anyio.run(main) == ("t@g",)


def _record(into: list[str], label: str, payload: Any) -> None:
    into.append(label)


def test_partials_of_one_function_are_different_handlers_so_pub_sub() -> None:
    """``functools.partial`` has no qualname of its own: each gets its own group."""
    seen: list[str] = []

    class Recorder:
        def __call__(self, payload: Any) -> None:
            seen.append("instance")

    async def main() -> None:
        bus = Bus()
        first = bus.subscribe("t", functools.partial(_record, seen, "a"), offload="inline")
        second = bus.subscribe("t", functools.partial(_record, seen, "b"), offload="inline")
        third = bus.subscribe("t", Recorder(), offload="inline")
        assert len({first.group, second.group, third.group}) == 3
        async with bus:
            receipt = await bus.publish("t", 1)
            assert len(receipt.accepted) == 3
            await bus.drain()

    anyio.run(main)
    assert sorted(seen) == ["a", "b", "instance"]


def test_batch_and_batch_error_import_from_asyncbus() -> None:
    import inspect

    batch_module = importlib.import_module("asyncbus._batch")
    exceptions = importlib.import_module("asyncbus._exceptions")
    assert asyncbus.Batch is batch_module.Batch
    assert asyncbus.BatchError is exceptions.BatchError
    assert {"Batch", "BatchError"} <= set(asyncbus.__all__)
    assert issubclass(asyncbus.BatchError, asyncbus.AsyncbusError)
    assert str(inspect.signature(asyncbus.Batch)) == (
        "(max_size: 'int' = 100, max_wait: 'float' = 0.05) -> None"
    )
    assert str(inspect.signature(asyncbus.BatchError)) == (
        "(failures: 'Mapping[int, BaseException]') -> 'None'"
    )
    assert asyncbus.Batch.__doc__ and asyncbus.BatchError.__doc__
