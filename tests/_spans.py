"""Finished OpenTelemetry spans as plain records, and the trees they form, as text.

Shared by the tracing tests and the traced worker process (which prints its spans
as JSON lines: :func:`record` then :func:`json.dumps`), so a trace that crosses
processes is put together from both sides and compared as one tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

#: Attributes shown in a tree line, in this order, when a span has them.
SHOWN = (
    ("messaging.consumer.group.name", "group"),
    ("messaging.asyncbus.attempt", "attempt"),
    ("messaging.asyncbus.outcome", "outcome"),
)


def record(span: ReadableSpan) -> dict[str, Any]:
    """What a test looks at of one finished span, JSON-safe."""
    context = span.context
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_id": f"{span.parent.span_id:016x}" if span.parent is not None else None,
        "status": span.status.status_code.name,
        "description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "links": [f"{link.context.span_id:016x}" for link in span.links],
        "events": [
            {"name": event.name, "attributes": dict(event.attributes or {})}
            for event in span.events
        ],
    }


def records(spans: Iterable[ReadableSpan]) -> list[dict[str, Any]]:
    """:func:`record` of each span."""
    return [record(span) for span in spans]


def _line(span: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> str:
    parts = [span["name"], f"[{span['kind']}]"]
    attributes = span["attributes"]
    parts += [f"{label}={attributes[key]}" for key, label in SHOWN if key in attributes]
    if span["status"] == StatusCode.ERROR.name:
        parts.append(f"ERROR({span['description']})")
    for event in span["events"]:
        parts.append(f"event={event['name']}")
    for link in span["links"]:
        target = by_id.get(link)
        if target is None:
            parts.append("link=?")
        else:
            attempt = target["attributes"].get("messaging.asyncbus.attempt")
            parts.append(f"link={target['name']}#{attempt}")
    return " ".join(parts)


def tree(spans: Iterable[dict[str, Any]]) -> str:
    """The spans as an indented tree, one line per span, roots first.

    Siblings are ordered by their line (name, group, attempt, ...), so a fan-out
    prints the same however its stages were scheduled. A span whose parent is not
    among ``spans`` is a root. Every span of a tree must share its root's trace id.
    """
    spans = list(spans)
    by_id = {span["span_id"]: span for span in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for span in spans:
        parent = span["parent_id"] if span["parent_id"] in by_id else None
        children.setdefault(parent, []).append(span)
    lines: list[str] = []

    def walk(parent: str | None, depth: int, trace_id: str | None) -> None:
        for span in sorted(children.get(parent, []), key=lambda each: _line(each, by_id)):
            if trace_id is not None:
                assert span["trace_id"] == trace_id, f"{span['name']} left its trace"
            lines.append("  " * depth + _line(span, by_id))
            walk(span["span_id"], depth + 1, span["trace_id"])

    walk(None, 0, None)
    return "\n".join(lines)


def named(spans: Iterable[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The spans called ``name``, by attempt."""
    found = [span for span in spans if span["name"] == name]
    return sorted(found, key=lambda span: span["attributes"].get("messaging.asyncbus.attempt", 0))
