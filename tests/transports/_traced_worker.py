"""A traced worker process for the tracing tests: one Bus over a broker, instrumented.

    python _traced_worker.py KIND URL PREFIX READY DONE

Stages: ``orders.created`` (group ``workers``; its first attempt fails and is retried,
the second returns the payload on down the slip), ``orders.audit`` (group ``audit``;
creates DONE), ``math.add`` (group ``calc``; returns ``a + b`` to the requester).
Creates READY once subscribed. On SIGTERM the bus drains and closes, and every span
the process finished is printed to stdout, one JSON object per line.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from asyncbus import Bus, Envelope, Retry
from asyncbus.integrations.opentelemetry import instrument

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
from _bus_worker import make_transport  # type: ignore[import-not-found]  # noqa: E402
from _spans import record  # type: ignore[import-not-found]  # noqa: E402


async def main(kind: str, url: str, prefix: str, ready: str, done: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    bus = Bus(transport=make_transport(kind, url, prefix), name="worker")
    instrument(bus, tracer_provider=provider)

    @bus.subscribe("orders.created", group="workers", retry=Retry(backoff=0.05, jitter=False))
    async def create(envelope: Envelope) -> Any:
        if envelope.attempt == 1:
            raise ConnectionError("warehouse busy")
        return envelope.payload

    @bus.subscribe("orders.audit", group="audit")
    async def audit(payload: Any) -> None:
        Path(done).touch()

    @bus.subscribe("math.add", group="calc")
    async def add(payload: dict[str, int]) -> int:
        return payload["a"] + payload["b"]

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with bus:
            Path(ready).touch()
            async for _ in signals:
                break
    for span in exporter.get_finished_spans():
        print(json.dumps(record(span)), flush=True)
    provider.shutdown()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:6])
