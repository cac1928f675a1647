"""asyncbus instrumented with OpenTelemetry: the cost of tracing, with and without an SDK.

Three more implementations of every workload, the same runners as asyncbus's own:

* ``otel``: ``instrument(bus)`` with only the API's global provider (no SDK set up),
  what a library user gets who installed the ``otel`` extra but traces nothing;
* ``otel-unsampled``: the SDK's ``TracerProvider`` with the ``ALWAYS_OFF`` sampler:
  the context still travels (W3C headers, current span in handlers), no span is
  recorded: what the unsampled share of a sampled production service costs;
* ``otel-sdk``: ``instrument(bus, tracer_provider=...)`` with the SDK's
  ``TracerProvider``, every span sampled and recorded, handed to a
  ``SimpleSpanProcessor`` whose exporter discards them: the cost of making the spans
  (and the W3C headers), not of shipping them anywhere.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from asyncbus import Bus

from ._asyncbus import Run, bus_runners

__all__ = ["TRACED_KEYS", "traced_runners", "tracing_unavailable"]

_providers: dict[str, Any] = {}

#: Implementation key -> whether it needs the SDK.
TRACED_KEYS = {"otel": False, "otel-unsampled": True, "otel-sdk": True}


def tracing_unavailable(key: str) -> str | None:
    """``None`` when implementation ``key`` can run here, else why not."""
    if importlib.util.find_spec("opentelemetry") is None:
        return "opentelemetry-api not installed"
    if TRACED_KEYS[key] and importlib.util.find_spec("opentelemetry.sdk") is None:
        return "opentelemetry-sdk not installed"
    return None


def _provider(key: str) -> Any:
    """The tracer provider of implementation ``key`` (one per process), ``None`` for the
    API's global one."""
    if key == "otel":
        return None  # no SDK is set up in the benchmark: the API's proxy
    if key not in _providers:
        from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
        from opentelemetry.sdk.trace.export import (
            SimpleSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

        class Discard(SpanExporter):
            def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        provider = TracerProvider(sampler=ALWAYS_OFF if key == "otel-unsampled" else ALWAYS_ON)
        provider.add_span_processor(SimpleSpanProcessor(Discard()))
        _providers[key] = provider
    return _providers[key]


def traced_runners(key: str) -> dict[str, Run]:
    """The asyncbus runner of each workload, on a bus instrumented as ``key`` says."""
    from asyncbus.integrations.opentelemetry import instrument

    def make_bus() -> Bus:
        bus = Bus()
        instrument(bus, tracer_provider=_provider(key))
        return bus

    return bus_runners(make_bus)
