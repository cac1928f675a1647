"""Trace every message end to end with OpenTelemetry.

Install with ``pip install 'asyncbus[otel]'`` (``opentelemetry-api``; add the SDK and an
exporter of your choice). ``import asyncbus`` never imports this module.

.. code-block:: python

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from asyncbus.integrations.opentelemetry import instrument

    trace.set_tracer_provider(TracerProvider())   # plus a span processor and exporter
    instrument(bus)                               # after the SDK is set up

What a trace holds (span names, kinds and parents):

* ``publish <topic>`` (PRODUCER) for each publish (``request <topic>`` for a request),
  a child of whatever span is current. It injects the W3C ``traceparent``,
  ``tracestate`` and ``baggage`` headers (through the global propagator,
  :func:`opentelemetry.propagate.inject`) into the envelope's headers, so the context
  travels with the envelope in memory and over every broker.
* ``process <pattern>`` (CONSUMER) for each attempt at each stage, a child of the
  span that sent the envelope; on a fan-out each group gets its own. A failed attempt
  that will be retried gets a ``retry`` event (delay, next attempt, exception type
  and message), and the next attempt's span is linked to the first attempt's. A dead
  letter sets the status ERROR (``"<reason>: <error>"``) and records the exception.
* Within a handler, whatever it sends is a child of its ``process`` span: a slip hop
  (``forward <topic>``), the reply to a request (``reply``), and its own publishes.
  A replay (``replay <topic>``) is a child of the span that first sent the envelope,
  linked to the span current where ``replay`` was called.
* The ``$deadletter`` announcement is ``announce $deadletter``.

Attributes follow the OpenTelemetry messaging semantic conventions:
``messaging.system`` (``asyncbus`` in memory, ``redis``, ``nats``, ``rabbitmq`` or
``postgresql`` over a broker), ``messaging.operation.type`` (``send`` / ``process``),
``messaging.operation.name``, ``messaging.destination.name`` (the topic),
``messaging.destination.template`` (the stage's pattern),
``messaging.destination.subscription.name`` (the stage), ``messaging.consumer.group.name``,
``messaging.message.id``, ``messaging.message.conversation_id`` (the correlation id);
and asyncbus's own: ``messaging.asyncbus.attempt``, ``messaging.asyncbus.causation_id``,
``messaging.asyncbus.outcome`` (``acked``, ``skipped``, ``retry``, ``deferred``, ``dead_lettered``,
``abandoned``) and ``messaging.asyncbus.dead_letter.reason``.

The tracer provider is looked at once, by :func:`instrument`: with only
``opentelemetry-api`` installed, or before the SDK's provider is set, there is nothing
to record, and the bus is left exactly as fast as an uninstrumented one (nothing is
attached). Set the provider first, or pass ``tracer_provider=``.
"""

from __future__ import annotations

import logging
import weakref
from contextvars import Token
from typing import Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "asyncbus.integrations.opentelemetry needs the 'otel' extra: pip install 'asyncbus[otel]'"
    ) from error

from .. import __version__
from .._bus import Bus
from .._carry import set_headers
from .._envelope import Envelope, Receipt
from .._instrument import Consumer, Instrumentation, Result, SendKind
from .._observe import attach, detach

__all__ = ["instrument", "uninstrument"]

logger = logging.getLogger("asyncbus.integrations.opentelemetry")

#: ``messaging.system`` of each transport name.
_SYSTEMS = {
    "memory": "asyncbus",
    "redis": "redis",
    "nats": "nats",
    "rabbit": "rabbitmq",
    "postgres": "postgresql",
}
#: ``messaging.operation.name`` (and the span name's first word) of each send.
_OPERATIONS: dict[str, str] = {
    "publish": "publish",
    "request": "request",
    "forward": "forward",
    "reply": "reply",
    "replay": "replay",
    "dead_letter": "announce",
}
#: First attempts remembered for the link from a retry (bounded: an envelope still
#: waiting for its retry when its bus closes is never settled here).
_MAX_FIRST_ATTEMPTS = 10_000

_instrumented: weakref.WeakKeyDictionary[Bus, _Tracing] = weakref.WeakKeyDictionary()


def instrument(bus: Bus, tracer_provider: trace.TracerProvider | None = None) -> None:
    """Trace ``bus``: a span per send and per attempt, the context in the headers.

    Calling it again replaces the previous instrumentation; it may be called on a
    running bus (dispatches already running finish untraced).

    :param tracer_provider: where spans go; by default the global provider
        (:func:`opentelemetry.trace.get_tracer_provider`), looked at now. When it is
        the API's no-op (no SDK set up yet), nothing is attached.
    """
    uninstrument(bus)
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        logger.info(
            "asyncbus: no OpenTelemetry SDK tracer provider is set; bus %r is not traced "
            "(set one up before instrument(), or pass tracer_provider=)",
            bus.name,
        )
        return
    tracing = _Tracing(trace.get_tracer("asyncbus", __version__, tracer_provider=provider))
    attach(bus, tracing)
    _instrumented[bus] = tracing


def uninstrument(bus: Bus) -> None:
    """Stop tracing ``bus`` (nothing happens if it is not traced)."""
    tracing = _instrumented.pop(bus, None)
    if tracing is not None:
        detach(bus, tracing)


def _exception_type(error: BaseException) -> str:
    # As the SDK's record_exception names it.
    kind = type(error)
    module = kind.__module__
    return kind.__qualname__ if module in (None, "builtins") else f"{module}.{kind.__qualname__}"


class _Attempt:
    """One traced attempt, from ``enter`` to ``exit``."""

    __slots__ = ("attached", "attempt", "key", "span")

    def __init__(
        self, span: Span, attached: Token[Context], key: tuple[str, str], attempt: int
    ) -> None:
        self.span = span
        self.attached = attached
        self.key = key
        self.attempt = attempt


class _Tracing(Instrumentation):
    """The hooks that open and close the spans."""

    __slots__ = ("first_attempts", "propagator", "stale", "tracer")

    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        #: (stage, envelope id) -> the span context of its first attempt, while retried.
        self.first_attempts: dict[tuple[str, str], SpanContext] = {}
        #: The global propagator last seen, and the header names it writes.
        self.propagator: object = None
        self.stale: frozenset[str] = frozenset()

    # -- sending -------------------------------------------------------------

    def send(self, kind: SendKind, envelope: Envelope, system: str) -> tuple[Envelope, object]:
        operation = _OPERATIONS[kind]
        attributes: dict[str, Any] = {
            "messaging.system": _SYSTEMS.get(system, system),
            "messaging.operation.type": "send",
            "messaging.operation.name": operation,
            "messaging.destination.name": envelope.topic,
            "messaging.message.id": envelope.id,
            "messaging.message.conversation_id": envelope.correlation_id,
        }
        if envelope.causation_id is not None:
            attributes["messaging.asyncbus.causation_id"] = envelope.causation_id
        if kind == "reply":
            # The requester's inbox: temporary, and no name worth grouping spans by.
            name = operation
            attributes["messaging.destination.temporary"] = True
            attributes["messaging.destination.anonymous"] = True
        else:
            name = f"{operation} {envelope.topic}"
        parent = None
        links = None
        if kind == "replay":
            # The same message again: continue the trace it was first sent in, linked
            # to whatever asked for the replay.
            original = propagate.extract(envelope.headers)
            if trace.get_current_span(original).get_span_context().is_valid:
                parent = original
                here = trace.get_current_span().get_span_context()
                links = [Link(here)] if here.is_valid else None
        span = self.tracer.start_span(
            name, context=parent, kind=SpanKind.PRODUCER, attributes=attributes, links=links
        )
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span, parent))
        # What the propagator writes: a hop's copy of the previous envelope's headers
        # loses those before the new ones go in (no stale parent, state or baggage).
        propagator = propagate.get_global_textmap()
        if propagator is not self.propagator:
            self.propagator, self.stale = propagator, frozenset(propagator.fields)
        stale = self.stale
        headers = envelope.headers
        if carrier or any(field in headers for field in stale):
            fields = {name: value for name, value in headers.items() if name not in stale}
            fields.update(carrier)
            envelope = set_headers(envelope, fields)
        return envelope, span

    def sent(self, token: object, receipt: Receipt | None, error: BaseException | None) -> None:
        span: Span = token  # type: ignore[assignment]
        if error is not None:
            if isinstance(error, Exception):
                span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        elif receipt is not None:
            if receipt.rejected:
                span.set_attribute("messaging.asyncbus.rejected", list(receipt.rejected))
            if receipt.dropped:
                span.set_attribute("messaging.asyncbus.dropped", list(receipt.dropped))
        span.end()

    # -- consuming -----------------------------------------------------------

    def enter(self, consumer: Consumer, envelope: Envelope) -> object:
        if consumer.internal:
            return None  # the request inbox: the reply's own span says it all
        parent = propagate.extract(envelope.headers)
        key = (consumer.stage, envelope.id)
        links = None
        if envelope.attempt > 1:
            first = self.first_attempts.get(key)
            if first is not None:
                links = [Link(first, {"messaging.asyncbus.link": "first_attempt"})]
        attributes: dict[str, Any] = {
            "messaging.system": _SYSTEMS.get(consumer.system, consumer.system),
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.destination.name": envelope.topic,
            "messaging.destination.template": consumer.pattern,
            "messaging.destination.subscription.name": consumer.stage,
            "messaging.consumer.group.name": consumer.group,
            "messaging.message.id": envelope.id,
            "messaging.message.conversation_id": envelope.correlation_id,
            "messaging.asyncbus.attempt": envelope.attempt,
        }
        if envelope.causation_id is not None:
            attributes["messaging.asyncbus.causation_id"] = envelope.causation_id
        span = self.tracer.start_span(
            f"process {consumer.pattern}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            links=links,
        )
        # Current for the handler: what it sends is a child of this span.
        attached = otel_context.attach(trace.set_span_in_context(span, parent))
        return _Attempt(span, attached, key, envelope.attempt)

    def exit(self, token: object, result: Result) -> None:
        if not isinstance(token, _Attempt):
            return  # the inbox, untraced
        span, key, attempt = token.span, token.key, token.attempt
        span.set_attribute("messaging.asyncbus.outcome", result.outcome)
        error = result.exception
        if result.outcome == "retry":
            event: dict[str, Any] = {
                "messaging.asyncbus.retry.delay": float(result.delay or 0.0),
                "messaging.asyncbus.retry.attempt": attempt + 1,
            }
            if error is not None:
                event["exception.type"] = _exception_type(error)
                event["exception.message"] = str(error)
            span.add_event("retry", event)
            self._remember_first(key, span)
        elif result.outcome == "deferred":
            # Put back, not failed: the next run of the same attempt links to this one.
            span.add_event(
                "deferred", {"messaging.asyncbus.defer.delay": float(result.delay or 0.0)}
            )
            self._remember_first(key, span)
        else:
            self.first_attempts.pop(key, None)
            if result.outcome == "dead_lettered":
                reason = result.reason or "dead_lettered"
                span.set_attribute("messaging.asyncbus.dead_letter.reason", reason)
                span.set_attribute("error.type", reason)
                if isinstance(error, Exception):
                    span.record_exception(error)
                description = f"{reason}: {result.error}" if result.error else reason
                span.set_status(Status(StatusCode.ERROR, description))
            elif result.outcome == "abandoned":
                span.set_status(Status(StatusCode.ERROR, "abandoned: cancelled unsettled"))
        otel_context.detach(token.attached)
        span.end()

    def _remember_first(self, key: Any, span: Any) -> None:
        """Keep the span context of an envelope's first run, for the runs that follow
        a retry or a deferral to link to (bounded: the oldest is forgotten)."""
        first_attempts = self.first_attempts
        if key not in first_attempts:
            if len(first_attempts) >= _MAX_FIRST_ATTEMPTS:
                del first_attempts[next(iter(first_attempts))]
            first_attempts[key] = span.get_span_context()
