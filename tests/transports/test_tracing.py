"""Tracing over real brokers: one trace across two processes, per broker.

The test publishes (and requests) through its own instrumented Bus; a worker process
(``_traced_worker.py``) handles with its own tracer provider and prints its spans as
JSON. The spans of both processes make one tree, exactly as in memory.
"""

from __future__ import annotations

import importlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asyncbus import Bus
from asyncbus.integrations.opentelemetry import instrument

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_traced_worker.py"
for folder in (str(HERE), str(HERE.parent)):
    if folder not in sys.path:
        sys.path.append(folder)
spans_module = importlib.import_module("_spans")
brokers = importlib.import_module("_brokers")
ACK_TIMEOUT = 2.0  # the traced worker's


def make_transport(kind: str, url: str, prefix: str) -> Any:
    """The ``kind`` transport with the workers' short ack timeout."""
    return brokers.make_transport(kind, url, prefix, ack_timeout=ACK_TIMEOUT)


@pytest.fixture(params=brokers.names())
async def broker(
    request: pytest.FixtureRequest, unique_prefix: str
) -> AsyncIterator[tuple[str, str]]:
    kind = request.param
    url = request.getfixturevalue(f"{kind}_url")
    yield kind, url
    with anyio.CancelScope(shield=True):
        await brokers.forget(kind, url, unique_prefix)


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_one_trace_crosses_processes_over_the_broker(
    broker: tuple[str, str],
    unique_prefix: str,
    tmp_path: Path,
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    kind, url = broker
    tracer_provider, exporter = provider
    ready, done = tmp_path / "ready", tmp_path / "done"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), kind, url, unique_prefix, str(ready), str(done)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        with anyio.fail_after(30):
            while not ready.exists():  # another process: its file is what there is
                assert worker.poll() is None, "worker exited early"
                await anyio.sleep(0.05)
        bus = Bus(transport=make_transport(kind, url, unique_prefix), name="publisher")
        instrument(bus, tracer_provider=tracer_provider)
        async with bus:
            receipt = await bus.publish("orders.created", {"id": 1}, slip=["orders.audit"])
            assert await bus.request("math.add", {"a": 2, "b": 3}, timeout=30) == 5
            with anyio.fail_after(30):
                while not done.exists():
                    await anyio.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        out, _ = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode == 0

    ours = spans_module.records(exporter.get_finished_spans())
    theirs = [json.loads(line) for line in out.splitlines() if line.strip()]
    spans = ours + theirs
    assert spans_module.tree(spans) == "\n".join(
        [
            "publish orders.created [PRODUCER]",
            "  process orders.created [CONSUMER] group=workers attempt=1 outcome=retry event=retry",
            "  process orders.created [CONSUMER] group=workers attempt=2 outcome=acked"
            " link=process orders.created#1",
            "    forward orders.audit [PRODUCER]",
            "      process orders.audit [CONSUMER] group=audit attempt=1 outcome=acked",
            "request math.add [PRODUCER]",
            "  process math.add [CONSUMER] group=calc attempt=1 outcome=acked",
            "    reply [PRODUCER]",
        ]
    )
    # Which process made which span: the sends at the top here, the rest there.
    assert sorted(span["name"] for span in ours) == ["publish orders.created", "request math.add"]
    assert {span["attributes"]["messaging.system"] for span in spans} == {
        brokers.BROKERS[kind].messaging_system
    }
    first, second = spans_module.named(spans, "process orders.created")
    assert first["attributes"]["messaging.message.id"] == receipt.id
    assert second["attributes"]["messaging.message.id"] == receipt.id
    assert first["events"][0]["attributes"]["exception.message"] == "warehouse busy"


request_id: ContextVar[str] = ContextVar("request_id", default="-")


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_contextvars_are_not_carried_over_a_broker(
    broker: tuple[str, str], unique_prefix: str
) -> None:
    kind, url = broker
    seen: list[str] = []
    handled = anyio.Event()

    async def look(payload: Any) -> None:
        seen.append(request_id.get())
        handled.set()

    bus = Bus(
        transport=make_transport(kind, url, unique_prefix),
        propagate_contextvars=[request_id],
    )
    bus.subscribe("t", look, group="g")
    with anyio.fail_after(30):
        async with bus:

            async def publish() -> None:
                request_id.set("r-1")
                await bus.publish("t", 1)

            async with anyio.create_task_group() as group:
                group.start_soon(publish)
            await handled.wait()
            await bus.drain()
    assert seen == ["-"]  # the envelope came back from the broker, its values left behind
