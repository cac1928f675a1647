"""Follow one order through the bus as one OpenTelemetry trace.

An HTTP request publishes an order with a routing slip; fulfilment fails once and is
retried, then sends the order on to ``orders.invoice``, where billing asks the tax
service (request/reply) and an audit stage gets a copy (fan-out). ``instrument(bus)``
turns all of it into one trace: a span per send and per attempt, the context carried
in the envelopes' W3C headers.

Run it (``pip install 'asyncbus[otel]' opentelemetry-sdk``):

    python examples/tracing.py             # the trace, as a tree
    python examples/tracing.py --console   # ... then every span, as the SDK prints it

In production, give the provider a ``BatchSpanProcessor`` with an OTLP exporter to
your collector (Jaeger, Tempo, Honeycomb, ...) instead of the console.
"""

import sys

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import asyncbus
from asyncbus import Bus, Envelope, Retry
from asyncbus.integrations.opentelemetry import instrument

spans = InMemorySpanExporter()
provider = TracerProvider(resource=Resource.create({"service.name": "orders"}))
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)  # the SDK first, then instrument()

bus = Bus(name="orders")
instrument(bus)
tracer = trace.get_tracer("orders.http")


@bus.subscribe("orders.created", group="fulfil", retry=Retry(backoff=0.01, jitter=False))
async def fulfil(envelope: Envelope) -> dict:
    """Reserve the stock; the warehouse is busy the first time."""
    if envelope.attempt == 1:
        raise ConnectionError("warehouse busy")
    return envelope.payload


@bus.subscribe("orders.invoice", group="billing")
async def invoice(order: dict) -> dict:
    """Ask the tax service, then bill the order."""
    tax = await bus.request("tax.quote", {"amount": order["amount"]})
    return {**order, "tax": tax}


@bus.subscribe("tax.quote", group="tax")
async def quote(request: dict) -> float:
    return round(request["amount"] * 0.2, 2)


@bus.subscribe("orders.invoice", group="audit")
async def audit(order: dict) -> None:
    """Another group on the same topic: gets every invoice too."""


def show(span: ReadableSpan, children: dict, depth: int = 0) -> None:
    attributes = span.attributes or {}
    detail = []
    if "messaging.consumer.group.name" in attributes:
        detail.append(f"group={attributes['messaging.consumer.group.name']}")
        detail.append(f"attempt={attributes['messaging.asyncbus.attempt']}")
        detail.append(str(attributes["messaging.asyncbus.outcome"]))
    detail += [f"event: {event.name}" for event in span.events]
    detail += ["linked to the first attempt" for _ in span.links]
    assert span.end_time is not None and span.start_time is not None
    took = (span.end_time - span.start_time) / 1e6
    line = f"{'  ' * depth}{span.name} [{span.kind.name}] {took:.2f} ms  {'  '.join(detail)}"
    print(line.rstrip())
    assert span.context is not None
    for child in children.get(span.context.span_id, []):
        show(child, children, depth + 1)


async def main() -> None:
    async with bus:
        with tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER):
            await bus.publish("orders.created", {"id": 7, "amount": 40.0}, slip=["orders.invoice"])
        await bus.drain()

    finished = sorted(spans.get_finished_spans(), key=lambda span: span.start_time or 0)
    children: dict = {}
    for span in finished:
        children.setdefault(span.parent.span_id if span.parent else None, []).append(span)
    (root,) = children[None]
    assert root.context is not None
    print(f"one trace, {len(finished)} spans, trace id {root.context.trace_id:032x}:")
    show(root, children)
    if "--console" in sys.argv[1:]:
        console = ConsoleSpanExporter()
        console.export(finished)


if __name__ == "__main__":
    asyncbus.run(main)
