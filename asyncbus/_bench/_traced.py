"""asyncbus instrumented with OpenTelemetry: the cost of tracing, with and without an SDK.

Two more implementations of every workload, the same runners as asyncbus's own:

* ``otel``: ``instrument(bus)`` with only the API's global provider (no SDK set up),
  what a library user gets who installed the ``otel`` extra but traces nothing;
* ``otel-sdk``: ``instrument(bus, tracer_provider=...)`` with the SDK's
  ``TracerProvider``, every span sampled and recorded, handed to a
  ``SimpleSpanProcessor`` whose exporter discards them: the cost of making the spans
  (and the W3C headers), not of shipping them anywhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from .. import Bus
from ._asyncbus import Run, bus_runners

__all__ = ["traced_runners", "tracing_unavailable"]

_provider: Any = None


def tracing_unavailable(recording: bool) -> str | None:
    """``None`` when the implementation can run here, else why not."""
    if importlib.util.find_spec("opentelemetry") is None:
        return "opentelemetry-api not installed"
    if recording and importlib.util.find_spec("opentelemetry.sdk") is None:
        return "opentelemetry-sdk not installed"
    return None


def _recording_provider() -> Any:
    global _provider
    if _provider is None:
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import (
            SimpleSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Discard(SpanExporter):
            def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        _provider = TracerProvider()
        _provider.add_span_processor(SimpleSpanProcessor(Discard()))
    return _provider


def _no_sdk_bus() -> Bus:
    from ..integrations.opentelemetry import instrument

    bus = Bus()
    instrument(bus)  # the API's global provider: no SDK is set up in the benchmark
    return bus


def _recording_bus() -> Bus:
    from ..integrations.opentelemetry import instrument

    bus = Bus()
    instrument(bus, tracer_provider=_recording_provider())
    return bus


def traced_runners(recording: bool) -> dict[str, Run]:
    """The asyncbus runner of each workload, on an instrumented bus."""
    return bus_runners(_recording_bus if recording else _no_sdk_bus)
