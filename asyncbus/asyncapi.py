"""Describe a bus as an AsyncAPI 3.0 document, for the teams and tools on its other side.

.. code-block:: python

    from asyncbus.asyncapi import document

    spec = document(bus, title="Orders", version="1.4.0",
                    publications={"orders.created": Order})
    json.dumps(spec)                     # a plain, JSON-ready dict

or from a shell: ``python -m asyncbus asyncapi myapp:bus > asyncapi.json``.

What the document holds:

* **channels**: one per topic pattern subscribed (and per topic in ``publications``).
  The address is the pattern, its wildcards written as parameters: ``*`` as
  ``{wildcard1}``, ``{wildcard2}``..., ``>`` as ``{rest}`` (``orders.*`` is the address
  ``orders.{wildcard1}``); the pattern itself is the channel's title and its
  ``x-asyncbus-pattern``.
* **operations**: a ``receive`` operation per stage (pattern and group), described by
  its handlers' docstrings, and a ``send`` operation per topic in ``publications``.
* **messages**: the payload schema comes from the handler's first parameter's
  annotation (a dataclass, ``msgspec.Struct``, pydantic model, TypedDict, or a plain
  type such as ``dict``, ``int``, ``list[str]``); a batch handler's ``list[Model]``
  gives ``Model``; a handler that takes the ``Envelope``, or has no annotation, gives
  ``{}`` (any payload). Every message has the envelope's headers as its headers.
* **servers**: the broker of the bus's transport (host, protocol ``redis``, ``nats``
  or ``amqp``), its credentials left out; none for a bus in memory.
"""

from __future__ import annotations

import copy
import inspect
import json
import typing
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ._bus import Bus
from ._chain import first_parameter_type
from ._dead_letters import DEADLETTER_TOPIC
from ._envelope import HEADER_KEY, HEADER_PRIORITY, HEADER_REPLAYED, Envelope
from ._exceptions import ConfigurationError
from ._observe import on_loop, subscriptions
from ._routing import compile_pattern
from ._schema import REF, Schema, Schemas, safe_name
from ._subscription import Subscription, unwrap_partial
from .transports._kit import redact
from .transports._registry import TRANSPORTS

__all__ = ["ASYNCAPI_VERSION", "document"]

#: The version of the AsyncAPI specification the documents follow.
ASYNCAPI_VERSION = "3.0.0"

#: The protocol of a broker URL's scheme; a URL without one takes its transport's.
_PROTOCOLS = {scheme: protocol for row in TRANSPORTS for scheme, protocol in row.schemes.items()}
_DEFAULT_SCHEMES = {row.name: row.default_scheme for row in TRANSPORTS}

_HEADERS: Schema = {
    "type": "object",
    "description": (
        "The envelope's headers: those given to publish(headers=...), and the bus's own "
        "(names beginning 'asyncbus-'). Every value is a string."
    ),
    "properties": {
        HEADER_KEY: {"type": "string", "description": "the publish key (ordering, partitions)"},
        HEADER_PRIORITY: {
            "type": "string",
            "enum": ["0", "1", "2"],
            "description": "the priority class: 0 low, 1 normal, 2 high",
        },
        HEADER_REPLAYED: {
            "type": "string",
            "description": "present on a dead letter sent again by replay",
        },
    },
    "additionalProperties": {"type": "string"},
}


def document(
    bus: Bus,
    *,
    title: str | None = None,
    version: str = "0.1.0",
    description: str | None = None,
    publications: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``bus``: its channels, operations, messages, servers.

    Read from the subscriptions made so far (the bus need not run); a plain dict that
    ``json.dumps`` takes as it is.

    :param title: the document's title (default: the bus's name).
    :param version: the version of the application the document describes.
    :param description: a description of the application (CommonMark).
    :param publications: the topics the application publishes, each with the type of
        its payload (``None`` or ``Any`` for any): ``{"orders.created": Order}``. Each
        becomes a ``send`` operation. The bus cannot know them by itself: a publish
        names its topic only when it is made.
    :raises ConfigurationError: for a title, version or description that is not a
        string, or a publication that is not a topic (or pattern).
    """
    title = (bus.name or "asyncbus") if title is None else title
    for name, value in (("title", title), ("version", version)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"document: {name} must be a non-empty string, got {value!r}")
    if description is not None and not isinstance(description, str):
        raise ConfigurationError(f"document: description must be a string, got {description!r}")
    if publications is not None and not isinstance(publications, Mapping):
        raise ConfigurationError(
            f"document: publications must map topics to payload types, got {publications!r}"
        )
    published = dict(publications or {})
    for topic in published:
        try:
            compile_pattern(topic)
        except ConfigurationError as error:
            raise ConfigurationError(f"document: publications: {error}") from None
    stages = on_loop(bus, lambda: subscriptions(bus))
    builder = _Builder()
    for stage in stages:
        builder.receive(stage)
    for topic, payload in published.items():
        builder.send(topic, payload)

    info: dict[str, Any] = {"title": title, "version": version}
    if description:
        info["description"] = description
    transport = bus.transport
    codec = getattr(transport, "codec", None)
    spec: dict[str, Any] = {
        "asyncapi": ASYNCAPI_VERSION,
        "info": info,
        "defaultContentType": getattr(codec, "content_type", None) or "application/json",
    }
    servers = _servers(transport)
    if servers:
        spec["servers"] = servers
    spec["channels"] = builder.channels
    spec["operations"] = builder.operations
    spec["components"] = {"schemas": dict(sorted(builder.schemas.components.items()))}
    spec["x-asyncbus-transport"] = "memory" if transport is None else transport.name
    return spec


class _Builder:
    """The channels and operations of one document, as they are added."""

    def __init__(self) -> None:
        self.schemas = Schemas()
        self.headers = self.schemas.add("EnvelopeHeaders", copy.deepcopy(_HEADERS))
        self.channels: dict[str, dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self._channel_ids: dict[str, str] = {}
        #: Per channel id: a message's JSON -> its id in the channel.
        self._messages: dict[str, dict[str, str]] = {}

    def receive(self, stage: tuple[Subscription, ...]) -> None:
        first = stage[0]
        channel = self._channel(first.topic)
        messages = [self._message(channel, *_payload(subscription)) for subscription in stage]
        operation: dict[str, Any] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel}"},
            "title": first.stage,
            "messages": list({ref["$ref"]: ref for ref in messages}.values()),
            "x-asyncbus-group": first.group,
            "x-asyncbus-handlers": [_handler_name(s.handler) for s in stage],
        }
        described = _description(stage)
        if described:
            operation["description"] = described
        self._operation(f"receive-{channel}-{safe_name(first.group)}", operation)

    def send(self, topic: str, payload: object) -> None:
        channel = self._channel(topic)
        untyped = "any payload" if payload is None or payload is Any else None
        message = self._message(channel, payload, untyped)
        operation = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel}"},
            "title": f"publish {topic}",
            "messages": [message],
        }
        self._operation(f"send-{channel}", operation)

    def _operation(self, name: str, operation: dict[str, Any]) -> None:
        self.operations[_free(name, self.operations)] = operation

    def _channel(self, pattern: str) -> str:
        known = self._channel_ids.get(pattern)
        if known is not None:
            return known
        tokens = pattern.split(".")
        name = _free(safe_name(".".join(_TOKEN_NAMES.get(t, t) for t in tokens)), self.channels)
        self._channel_ids[pattern] = name
        self._messages[name] = {}
        channel: dict[str, Any] = {"address": pattern, "title": pattern, "messages": {}}
        parameters: dict[str, Any] = {}
        address: list[str] = []
        for token in tokens:
            if token == "*":
                parameter = f"wildcard{len(parameters) + 1}"
                parameters[parameter] = {"description": "'*' of the pattern: any one token"}
            elif token == ">":
                parameter = "rest"
                parameters[parameter] = {
                    "description": "'>' of the pattern: one or more tokens, dots included"
                }
            else:
                address.append(token)
                continue
            address.append(f"{{{parameter}}}")
        if "{" in pattern or "}" in pattern:
            # A brace would read as a parameter: the address cannot be written.
            channel["address"] = None
            channel["x-asyncbus-pattern"] = pattern
        elif parameters:
            channel["address"] = ".".join(address)
            channel["parameters"] = parameters
            channel["x-asyncbus-pattern"] = pattern
        if pattern == DEADLETTER_TOPIC:
            channel["description"] = (
                "Dead letters of this bus, announced to subscribers in its own process."
            )
        elif parameters:
            channel["description"] = (
                "A subscription pattern: tokens split on '.', '*' matches one token, '>' the rest."
            )
        self.channels[name] = channel
        return name

    def _message(self, channel: str, annotation: object, untyped: str | None) -> dict[str, str]:
        """A reference to the channel's message for payloads of type ``annotation``."""
        message: dict[str, Any]
        if untyped is not None:
            message = {"title": "any payload", "description": untyped, "payload": {}}
        else:
            message = {"title": _type_text(annotation), "payload": self.schemas.of(annotation)}
        message["headers"] = dict(self.headers)
        key = json.dumps(message, sort_keys=True)
        known = self._messages[channel]
        name = known.get(key)
        if name is None:
            payload = message["payload"]
            reference = payload.get("$ref", "")
            base = reference[len(REF) :] if reference.startswith(REF) else message["title"]
            name = _free(safe_name(base), self.channels[channel]["messages"])
            known[key] = name
            self.channels[channel]["messages"][name] = {"name": name, **message}
        return {"$ref": f"#/channels/{channel}/messages/{name}"}


#: How a wildcard token reads in a channel's id.
_TOKEN_NAMES = {"*": "any", ">": "rest"}


def _free(name: str, taken: Mapping[str, object]) -> str:
    if name not in taken:
        return name
    number = 2
    while f"{name}-{number}" in taken:
        number += 1
    return f"{name}-{number}"


def _payload(subscription: Subscription) -> tuple[object, str | None]:
    """The annotation of the subscription's payloads, or why there is none."""
    annotation = first_parameter_type(subscription.handler)
    if subscription.batch is not None:
        arguments = typing.get_args(annotation)
        annotation = arguments[0] if arguments else None
    if annotation is Envelope:
        return None, "the handler takes the whole envelope: any payload"
    if annotation is None or annotation is Any:
        return None, "the handler's payload is not annotated: any payload"
    return annotation, None


def _handler_name(handler: Any) -> str:
    function = unwrap_partial(handler)
    module = getattr(function, "__module__", None) or "?"
    return f"{module}:{getattr(function, '__qualname__', type(function).__qualname__)}"


def _description(stage: tuple[Subscription, ...]) -> str:
    docs = [(s, inspect.getdoc(unwrap_partial(s.handler))) for s in stage]
    if len(stage) == 1:
        return docs[0][1] or ""
    return "\n\n".join(f"`{_handler_name(s.handler)}`: {doc}" for s, doc in docs if doc)


def _type_text(annotation: object) -> str:
    """How ``annotation`` is written, without module names (``list[Order]``)."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    text = repr(annotation).replace("typing.", "").replace("collections.abc.", "")
    for argument in _walk_arguments(annotation):
        if isinstance(argument, type):
            written = f"{argument.__module__}.{argument.__qualname__}"
            text = text.replace(written, argument.__name__)
    return text


def _walk_arguments(annotation: object) -> list[object]:
    found: list[object] = []
    for argument in typing.get_args(annotation):
        found.append(argument)
        found.extend(_walk_arguments(argument))
    return found


def _servers(transport: object) -> dict[str, Any]:
    """The broker's servers, from the transport's URL(s); none in memory."""
    url = getattr(transport, "url", None)
    if url is None:
        return {}
    urls = [str(u) for u in url] if isinstance(url, list | tuple) else str(url).split(",")
    kind = getattr(transport, "name", "server")
    servers: dict[str, Any] = {}
    for each in (u.strip() for u in urls):
        if not each:
            continue
        shown = redact(each if "://" in each else f"{_DEFAULT_SCHEMES.get(kind, kind)}://{each}")
        scheme, _, rest = shown.partition("://")
        try:
            netloc, path = urlsplit(shown)[1:3]
        except ValueError:  # not a URL (an unbalanced "[" in the host): as written
            netloc, path = rest.partition("/")[0], ""
        server: dict[str, Any] = {
            "host": netloc.rpartition("@")[2] or "localhost",
            "protocol": _PROTOCOLS.get(scheme, scheme),
        }
        if path:
            server["pathname"] = path
        prefix = getattr(transport, "prefix", None)
        about = f"{type(transport).__name__} at {shown}"
        server["description"] = about + (f", prefix {prefix!r}" if prefix else "")
        servers[_free(safe_name(kind), servers)] = server
    return servers
