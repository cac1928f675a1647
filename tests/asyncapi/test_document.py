"""``asyncbus.asyncapi.document``: the AsyncAPI 3.0 document of a bus, field by field.

The official parser validates these documents in tests/asyncapi/; here the content is
pinned: channels, operations, message schemas of every payload kind, servers.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, NewType, NotRequired, Optional, TypedDict

import anyio
import msgspec
import pydantic
import pytest

from asyncbus import (
    DEADLETTER_TOPIC,
    Batch,
    Bus,
    ConfigurationError,
    DeadLetter,
    Envelope,
)
from asyncbus.asyncapi import document
from asyncbus.transports import MemoryTransport, NatsTransport, RabbitTransport, RedisTransport

HEADERS = {"$ref": "#/components/schemas/EnvelopeHeaders"}
ANY = "any payload"


@dataclasses.dataclass
class Order:
    """An order, as the shop takes it."""

    id: int
    item: str
    quantity: int = 1


def test_the_document_of_a_small_bus_exactly() -> None:
    bus = Bus(name="shop")

    @bus.subscribe("orders.created", group="mailer")
    async def mail(order: Order) -> None:
        """Send the order's confirmation.

        One mail per order.
        """

    @bus.subscribe("orders.*", group="audit")
    async def audit(env: Envelope) -> None:
        pass

    spec = document(bus, title="Shop", version="1.2.3", publications={"orders.created": Order})

    assert spec == {
        "asyncapi": "3.0.0",
        "info": {"title": "Shop", "version": "1.2.3"},
        "defaultContentType": "application/json",
        "channels": {
            "orders.created": {
                "address": "orders.created",
                "title": "orders.created",
                "messages": {
                    "Order": {
                        "name": "Order",
                        "title": "Order",
                        "payload": {"$ref": "#/components/schemas/Order"},
                        "headers": HEADERS,
                    }
                },
            },
            "orders.any": {
                "address": "orders.{wildcard1}",
                "title": "orders.*",
                "messages": {
                    "any_payload": {
                        "name": "any_payload",
                        "title": ANY,
                        "description": "the handler takes the whole envelope: any payload",
                        "payload": {},
                        "headers": HEADERS,
                    }
                },
                "parameters": {"wildcard1": {"description": "'*' of the pattern: any one token"}},
                "x-asyncbus-pattern": "orders.*",
                "description": "A subscription pattern: tokens split on '.', '*' matches one "
                "token, '>' the rest.",
            },
        },
        "operations": {
            "receive-orders.created-mailer": {
                "action": "receive",
                "channel": {"$ref": "#/channels/orders.created"},
                "title": "orders.created@mailer",
                "messages": [{"$ref": "#/channels/orders.created/messages/Order"}],
                "x-asyncbus-group": "mailer",
                "x-asyncbus-handlers": [f"{__name__}:{mail.__qualname__}"],
                "description": "Send the order's confirmation.\n\nOne mail per order.",
            },
            "receive-orders.any-audit": {
                "action": "receive",
                "channel": {"$ref": "#/channels/orders.any"},
                "title": "orders.*@audit",
                "messages": [{"$ref": "#/channels/orders.any/messages/any_payload"}],
                "x-asyncbus-group": "audit",
                "x-asyncbus-handlers": [f"{__name__}:{audit.__qualname__}"],
            },
            "send-orders.created": {
                "action": "send",
                "channel": {"$ref": "#/channels/orders.created"},
                "title": "publish orders.created",
                "messages": [{"$ref": "#/channels/orders.created/messages/Order"}],
            },
        },
        "components": {
            "schemas": {
                "EnvelopeHeaders": {
                    "type": "object",
                    "description": "The envelope's headers: those given to "
                    "publish(headers=...), and the bus's own (names beginning 'asyncbus-'). "
                    "Every value is a string.",
                    "properties": {
                        "asyncbus-key": {
                            "type": "string",
                            "description": "the publish key (ordering, partitions)",
                        },
                        "asyncbus-priority": {
                            "type": "string",
                            "enum": ["0", "1", "2"],
                            "description": "the priority class: 0 low, 1 normal, 2 high",
                        },
                        "asyncbus-replayed": {
                            "type": "string",
                            "description": "present on a dead letter sent again by replay",
                        },
                    },
                    "additionalProperties": {"type": "string"},
                },
                "Order": {
                    "type": "object",
                    "title": "Order",
                    "properties": {
                        "id": {"type": "integer"},
                        "item": {"type": "string"},
                        "quantity": {"type": "integer", "default": 1},
                    },
                    "required": ["id", "item"],
                    "description": "An order, as the shop takes it.",
                },
            }
        },
        "x-asyncbus-transport": "memory",
    }
    assert json.loads(json.dumps(spec, allow_nan=False)) == spec


def test_defaults_title_the_bus_and_the_document_needs_no_running_bus() -> None:
    bus = Bus(name="billing")
    spec = document(bus)
    assert spec["info"] == {"title": "billing", "version": "0.1.0"}
    assert (spec["channels"], spec["operations"]) == ({}, {})
    assert not bus.running
    assert document(Bus(name=""))["info"]["title"] == "asyncbus"


def test_changing_a_document_changes_no_other() -> None:
    bus = Bus()
    bus.subscribe("orders", lambda order: None, group="a")
    bus.subscribe("refunds", lambda refund: None, group="b")
    spec = document(bus)
    headers = spec["components"]["schemas"]["EnvelopeHeaders"]
    headers["properties"].clear()
    spec["channels"]["orders"]["messages"]["any_payload"]["headers"]["$ref"] = "#/elsewhere"
    again = document(bus)
    assert len(again["components"]["schemas"]["EnvelopeHeaders"]["properties"]) == 3
    assert again["channels"]["refunds"]["messages"]["any_payload"]["headers"] == HEADERS
    assert spec["channels"]["refunds"]["messages"]["any_payload"]["headers"] == HEADERS


@pytest.mark.anyio
async def test_a_document_made_in_a_handler_or_another_thread_sees_every_stage() -> None:
    bus = Bus()
    made: list[dict[str, Any]] = []

    @bus.subscribe("describe", group="self")
    async def describe(payload: None) -> None:
        made.append(document(bus))

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("describe")
            await bus.drain()
            made.append(await anyio.to_thread.run_sync(document, bus))
    assert made[0] == made[1] == document(bus)
    assert list(made[0]["operations"]) == ["receive-describe-self"]


# -- channels -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "address", "parameters", "channel"),
    [
        ("orders.*.shipped", "orders.{wildcard1}.shipped", ["wildcard1"], "orders.any.shipped"),
        ("audit.>", "audit.{rest}", ["rest"], "audit.rest"),
        (
            "*.*.>",
            "{wildcard1}.{wildcard2}.{rest}",
            ["wildcard1", "wildcard2", "rest"],
            "any.any.rest",
        ),
        (">", "{rest}", ["rest"], "rest"),
    ],
)
def test_wildcards_become_parameters_of_the_address(
    pattern: str, address: str, parameters: list[str], channel: str
) -> None:
    bus = Bus()
    bus.subscribe(pattern, lambda payload: None, group="g")
    spec = document(bus)
    assert list(spec["channels"]) == [channel]
    found = spec["channels"][channel]
    assert (found["address"], list(found["parameters"]), found["x-asyncbus-pattern"]) == (
        address,
        parameters,
        pattern,
    )
    assert found["title"] == pattern


def test_a_topic_with_a_brace_has_no_address_and_keeps_its_pattern() -> None:
    bus = Bus()
    bus.subscribe("orders.{id}", lambda payload: None, group="g")
    (channel,) = document(bus)["channels"].values()
    assert (channel["address"], channel["x-asyncbus-pattern"]) == (None, "orders.{id}")
    assert "parameters" not in channel


def test_channel_ids_stay_distinct_when_patterns_read_alike() -> None:
    bus = Bus()
    for pattern in ("orders.*", "orders.any", "orders.$any"):
        bus.subscribe(pattern, lambda payload: None, group="g")
    channels = document(bus)["channels"]
    assert {key: channel["title"] for key, channel in channels.items()} == {
        "orders.any": "orders.*",
        "orders.any-2": "orders.any",
        "orders._any": "orders.$any",
    }


def test_dead_letters_subscribed_on_their_topic_are_a_channel_with_their_schema() -> None:
    bus = Bus()

    @bus.subscribe(DEADLETTER_TOPIC, group="alerts")
    async def alert(dead: DeadLetter) -> None:
        """Page someone."""

    spec = document(bus)
    channel = spec["channels"]["deadletter"]
    assert channel["address"] == "$deadletter"
    assert "in its own process" in channel["description"]
    assert channel["messages"]["DeadLetter"]["payload"] == {
        "$ref": "#/components/schemas/DeadLetter"
    }
    dead_letter = spec["components"]["schemas"]["DeadLetter"]
    assert dead_letter["properties"]["envelope"] == {"$ref": "#/components/schemas/Envelope"}
    assert dead_letter["properties"]["reason"]["enum"] == [
        "no_subscribers",
        "handler_failed",
        "rejected",
        "expired",
        "dropped",
        "timeout",
        "overload",
        "key_stopped",
    ]
    assert spec["components"]["schemas"]["Envelope"]["properties"]["headers"] == {
        "type": "object",
        "additionalProperties": {"type": "string"},
    }


# -- operations -----------------------------------------------------------------------


def test_competing_handlers_of_one_stage_are_one_operation_with_each_message() -> None:
    bus = Bus()

    @bus.subscribe("jobs", group="workers")
    async def resize(job: Order) -> None:
        """Resize the image."""

    @bus.subscribe("jobs", group="workers")
    async def crop(job: dict[str, str]) -> None:
        """Crop the image."""

    @bus.subscribe("jobs", group="workers")
    async def also_resize(job: Order) -> None:
        pass

    spec = document(bus)
    (operation,) = spec["operations"].values()
    assert operation["messages"] == [
        {"$ref": "#/channels/jobs/messages/Order"},
        {"$ref": "#/channels/jobs/messages/dict_str_str"},
    ]
    assert operation["description"] == (
        f"`{__name__}:{resize.__qualname__}`: Resize the image.\n\n"
        f"`{__name__}:{crop.__qualname__}`: Crop the image."
    )
    assert len(operation["x-asyncbus-handlers"]) == 3
    assert spec["channels"]["jobs"]["messages"]["dict_str_str"]["payload"] == {
        "type": "object",
        "additionalProperties": {"type": "string"},
    }


def test_fan_out_groups_are_one_operation_each_on_one_channel() -> None:
    bus = Bus()
    bus.subscribe("orders.created", lambda order: None, group="mailer")
    bus.subscribe("orders.created", lambda order: None, group="warehouse")
    spec = document(bus)
    assert list(spec["channels"]) == ["orders.created"]
    assert list(spec["operations"]) == [
        "receive-orders.created-mailer",
        "receive-orders.created-warehouse",
    ]


def test_default_groups_and_callables_are_named_by_their_function() -> None:
    bus = Bus()

    class Counter:
        """Counts what it is given."""

        def __call__(self, payload: int) -> None:
            pass

    def scaled(factor: float, payload: float) -> float:
        """Scale the reading."""
        return factor * payload

    bus.subscribe("counts", Counter())
    bus.subscribe("readings", functools.partial(scaled, 2.0))
    spec = document(bus)
    count, reading = spec["operations"].values()
    assert count["x-asyncbus-handlers"] == [f"{__name__}:{Counter.__qualname__}"]
    assert count["description"] == "Counts what it is given."
    assert reading["x-asyncbus-handlers"] == [f"{__name__}:{scaled.__qualname__}"]
    assert reading["description"] == "Scale the reading."


def test_publications_become_send_operations_and_share_channels() -> None:
    bus = Bus()
    bus.subscribe("orders.created", lambda order: None, group="mailer")
    spec = document(
        bus,
        publications={"orders.created": Order, "orders.cancelled": None, "metrics.>": dict},
    )
    assert list(spec["channels"]) == ["orders.created", "orders.cancelled", "metrics.rest"]
    assert {key: op["action"] for key, op in spec["operations"].items()} == {
        "receive-orders.created-mailer": "receive",
        "send-orders.created": "send",
        "send-orders.cancelled": "send",
        "send-metrics.rest": "send",
    }
    assert spec["channels"]["orders.cancelled"]["messages"]["any_payload"]["payload"] == {}
    assert spec["channels"]["metrics.rest"]["address"] == "metrics.{rest}"
    assert spec["operations"]["send-orders.created"]["messages"] == [
        {"$ref": "#/channels/orders.created/messages/Order"}
    ]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"title": ""}, "title must be a non-empty string"),
        ({"title": 3}, "title must be a non-empty string"),
        ({"version": None}, "version must be a non-empty string"),
        ({"description": b"x"}, "description must be a string"),
        ({"publications": {"orders..created": dict}}, "empty token"),
        ({"publications": {"orders.>.x": dict}}, "'>' may only be the last token"),
        ({"publications": {3: dict}}, "pattern must be a non-empty string, got 3"),
        ({"publications": ["orders.created"]}, "publications must map topics to payload types"),
    ],
)
def test_bad_arguments_are_configuration_errors(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        document(Bus(), **arguments)


@pytest.mark.anyio
async def test_the_reply_inbox_of_a_request_is_not_part_of_the_document() -> None:
    bus = Bus(transport=MemoryTransport(direct=False))

    @bus.subscribe("math.add", group="adder")
    async def add(numbers: list[int]) -> int:
        return sum(numbers)

    before = document(bus)
    with anyio.fail_after(10):
        async with bus:
            assert await bus.request("math.add", [1, 2], timeout=5) == 3
            assert len(bus.statistics().stages) == 2  # the inbox is a stage
            during = document(bus)
    assert during == before
    assert list(during["operations"]) == ["receive-math.add-adder"]


# -- payload schemas ------------------------------------------------------------------


class Colour(enum.Enum):
    """A colour of the range."""

    RED = "red"
    BLUE = "blue"


class Size(enum.IntEnum):
    S = 1
    M = 2


class Point(TypedDict):
    """A point on the map."""

    x: float
    y: float
    label: NotRequired[str]


class Item(msgspec.Struct):
    sku: str
    quantity: int = 1


class Cart(msgspec.Struct):
    items: list[Item]
    owner: str


class Card(msgspec.Struct, tag="card"):
    number: str


class Cash(msgspec.Struct, tag="cash"):
    amount: float


class Payment(msgspec.Struct):
    method: Card | Cash


class Customer(pydantic.BaseModel):
    """Who orders."""

    name: str
    tags: list[str] = []
    location: tuple[float, float]


class Invoice(pydantic.BaseModel):
    customer: Customer
    total: float


@dataclasses.dataclass
class Node:
    value: int
    children: list[Node] = dataclasses.field(default_factory=list)


Sku = NewType("Sku", str)


def annotated(annotation: Any) -> Any:
    """A handler whose payload parameter is annotated ``annotation`` (``None``: bare)."""

    async def handler(payload):  # type: ignore[no-untyped-def]
        pass

    if annotation is not None:
        handler.__annotations__ = {"payload": annotation, "return": None}
    return handler


def payload_of(annotation: Any, *, batch: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The payload schema of a handler annotated ``annotation``, and the components."""
    bus = Bus()
    bus.subscribe("t", annotated(annotation), batch=Batch(max_size=10) if batch else None)
    spec = document(bus)
    (message,) = spec["channels"]["t"]["messages"].values()
    components = spec["components"]["schemas"]
    del components["EnvelopeHeaders"]
    return message["payload"], components


STRING_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}


@pytest.mark.parametrize(
    ("annotation", "payload"),
    [
        (dict, {"type": "object"}),
        (int, {"type": "integer"}),
        (str, {"type": "string"}),
        (float, {"type": "number"}),
        (bool, {"type": "boolean"}),
        (bytes, {"type": "string", "contentEncoding": "base64"}),
        (list, {"type": "array"}),
        (list[int], {"type": "array", "items": {"type": "integer"}}),
        (Sequence[str], {"type": "array", "items": {"type": "string"}}),
        (set[int], {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
        (tuple[int, ...], {"type": "array", "items": {"type": "integer"}}),
        (
            tuple[int, str],
            {
                "type": "array",
                "items": [{"type": "integer"}, {"type": "string"}],
                "minItems": 2,
                "maxItems": 2,
            },
        ),
        (dict[str, float], {"type": "object", "additionalProperties": {"type": "number"}}),
        (Mapping[str, Any], {"type": "object"}),
        (str | None, STRING_OR_NULL),
        (Optional[str], STRING_OR_NULL),  # noqa: UP045 - the old spelling is the point
        (Literal["a", "b"], {"enum": ["a", "b"], "type": "string"}),
        (Literal[1, "one"], {"enum": [1, "one"]}),
        (datetime.datetime, {"type": "string", "format": "date-time"}),
        (uuid.UUID, {"type": "string", "format": "uuid"}),
        (Annotated[int, "meta"], {"type": "integer"}),
        (Sku, {"type": "string"}),
        (
            Colour,
            {
                "enum": ["red", "blue"],
                "type": "string",
                "title": "Colour",
                "description": "A colour of the range.",
            },
        ),
        (Size, {"enum": [1, 2], "type": "integer", "title": "Size"}),
        (Any, {}),
        (object, {}),
    ],
    ids=repr,
)
def test_plain_types_give_their_json_schema(annotation: Any, payload: dict[str, Any]) -> None:
    assert payload_of(annotation) == (payload, {})


@pytest.mark.parametrize(
    ("annotation", "batch", "reason"),
    [
        (Envelope, False, "the handler takes the whole envelope: any payload"),
        (None, False, "the handler's payload is not annotated: any payload"),
        (list[Envelope], True, "the handler takes the whole envelope: any payload"),
        (list, True, "the handler's payload is not annotated: any payload"),
        (None, True, "the handler's payload is not annotated: any payload"),
    ],
)
def test_envelopes_and_unannotated_payloads_are_any_payload(
    annotation: Any, batch: bool, reason: str
) -> None:
    bus = Bus()
    bus.subscribe("t", annotated(annotation), batch=Batch(max_size=10) if batch else None)
    (message,) = document(bus)["channels"]["t"]["messages"].values()
    assert message == {
        "name": "any_payload",
        "title": ANY,
        "description": reason,
        "payload": {},
        "headers": HEADERS,
    }


def test_a_batch_handler_of_models_documents_one_model() -> None:
    assert payload_of(list[Item], batch=True) == payload_of(Item)
    payload, components = payload_of(list[Item], batch=True)
    assert payload == {"$ref": "#/components/schemas/Item"}
    assert list(components) == ["Item"]
    assert payload_of(Sequence[int], batch=True) == ({"type": "integer"}, {})


def test_a_dataclass_is_a_component_with_its_required_fields_and_defaults() -> None:
    assert payload_of(Node) == (
        {"$ref": "#/components/schemas/Node"},
        {
            "Node": {
                "type": "object",
                "title": "Node",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {
                        "type": "array",
                        "items": {"$ref": "#/components/schemas/Node"},
                    },
                },
                "required": ["value"],
            }
        },
    )


def test_a_typeddict_is_a_component_with_its_required_keys() -> None:
    assert payload_of(Point) == (
        {"$ref": "#/components/schemas/Point"},
        {
            "Point": {
                "type": "object",
                "title": "Point",
                "properties": {
                    "x": {"type": "number"},
                    "y": {"type": "number"},
                    "label": {"type": "string"},
                },
                "required": ["x", "y"],
                "description": "A point on the map.",
            }
        },
    )


def test_a_msgspec_struct_is_described_by_msgspec_with_its_nested_structs() -> None:
    assert payload_of(Cart) == (
        {"$ref": "#/components/schemas/Cart"},
        {
            "Cart": {
                "title": "Cart",
                "type": "object",
                "properties": {
                    "items": {"type": "array", "items": {"$ref": "#/components/schemas/Item"}},
                    "owner": {"type": "string"},
                },
                "required": ["items", "owner"],
            },
            "Item": {
                "title": "Item",
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "default": 1},
                },
                "required": ["sku"],
            },
        },
    )


def test_a_tagged_union_names_its_discriminator_as_asyncapi_expects() -> None:
    _, components = payload_of(Payment)
    method = components["Payment"]["properties"]["method"]
    assert method == {
        "anyOf": [{"$ref": "#/components/schemas/Card"}, {"$ref": "#/components/schemas/Cash"}],
        "discriminator": "type",
    }
    assert components["Card"]["properties"]["type"] == {"enum": ["card"]}


def test_a_pydantic_model_is_described_by_pydantic_in_draft_07_terms() -> None:
    payload, components = payload_of(Invoice)
    assert payload == {"$ref": "#/components/schemas/Invoice"}
    assert components == {
        "Customer": {
            "title": "Customer",
            "type": "object",
            "description": "Who orders.",
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "tags": {
                    "title": "Tags",
                    "type": "array",
                    "items": {"type": "string"},
                    "default": [],
                },
                "location": {
                    "title": "Location",
                    "type": "array",
                    "items": [{"type": "number"}, {"type": "number"}],
                    "minItems": 2,
                    "maxItems": 2,
                },
            },
            "required": ["name", "location"],
        },
        "Invoice": {
            "title": "Invoice",
            "type": "object",
            "properties": {
                "customer": {"$ref": "#/components/schemas/Customer"},
                "total": {"title": "Total", "type": "number"},
            },
            "required": ["customer", "total"],
        },
    }


def test_a_type_used_by_several_messages_is_one_component() -> None:
    bus = Bus()
    bus.subscribe("carts", lambda cart: None, group="a")

    async def by_cart(cart: Cart) -> None:
        pass

    async def by_item(item: Item) -> None:
        pass

    async def by_customer(customer: Customer) -> None:
        pass

    async def by_invoice(invoice: Invoice) -> None:
        pass

    for topic, handler in (
        ("carts", by_cart),
        ("items", by_item),
        ("customers", by_customer),
        ("invoices", by_invoice),
        ("carts.again", by_cart),
    ):
        bus.subscribe(topic, handler)
    schemas = document(bus)["components"]["schemas"]
    assert sorted(schemas) == ["Cart", "Customer", "EnvelopeHeaders", "Invoice", "Item"]


def test_two_types_of_one_name_get_a_component_each() -> None:
    def make() -> type:
        @dataclasses.dataclass
        class Order:
            reference: str

        return Order

    class Item(msgspec.Struct):  # not the module's Item
        code: int

    local_order = make()
    bus = Bus()

    # d: a Cart, which refers to the module's Item
    for topic, annotation in (("a", Order), ("b", local_order), ("c", Item), ("d", Cart)):
        bus.subscribe(topic, annotated(annotation))
    spec = document(bus)
    schemas = spec["components"]["schemas"]
    # The second Order is named by its module and qualified name, made fit for a name.
    qualified = re.sub(r"[^\w.-]+", "_", f"{__name__}.{local_order.__qualname__}")
    names = {topic: spec["channels"][topic]["messages"] for topic in "abcd"}
    assert [next(iter(messages.values()))["payload"] for messages in names.values()] == [
        {"$ref": "#/components/schemas/Order"},
        {"$ref": f"#/components/schemas/{qualified}"},
        {"$ref": "#/components/schemas/Item"},
        {"$ref": "#/components/schemas/Cart"},
    ]
    assert schemas["Order"]["properties"] == {
        "id": {"type": "integer"},
        "item": {"type": "string"},
        "quantity": {"type": "integer", "default": 1},
    }
    assert schemas["Item"]["properties"] == {"code": {"type": "integer"}}
    cart_item = schemas["Cart"]["properties"]["items"]["items"]["$ref"]
    assert cart_item == "#/components/schemas/Item-2"
    assert schemas["Item-2"]["properties"]["sku"] == {"type": "string"}


def test_a_model_its_library_cannot_describe_says_so_and_the_document_stays_valid() -> None:
    class Opaque:
        pass

    class Odd(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
        thing: Opaque

    payload, components = payload_of(Odd)
    assert payload == {
        "description": "no schema for " + Odd.__qualname__ + ": PydanticInvalidForJsonSchema"
    }
    assert components == {}


def test_defaults_that_json_cannot_hold_are_left_out() -> None:
    @dataclasses.dataclass
    class Reading:
        value: float = math.nan
        scale: float = 1.5
        unit: object = dataclasses.field(default_factory=object)

    _, components = payload_of(Reading)
    assert components["Reading"]["properties"] == {
        "value": {"type": "number"},
        "scale": {"type": "number", "default": 1.5},
        "unit": {},
    }
    json.dumps(components, allow_nan=False)


# -- servers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("transport", "servers", "secrets"),
    [
        (
            lambda: RedisTransport("redis://app:hunter2@cache.local:6380/3", prefix="shop"),
            {
                "redis": {
                    "host": "cache.local:6380",
                    "protocol": "redis",
                    "pathname": "/3",
                    "description": "RedisTransport at redis://app:***@cache.local:6380/3, "
                    "prefix 'shop'",
                }
            },
            ["hunter2"],
        ),
        (
            lambda: RedisTransport("rediss://:tok3n@cache.local?password=p4ss&db=1"),
            {
                "redis": {
                    "host": "cache.local",
                    "protocol": "redis",
                    "description": "RedisTransport at rediss://***@cache.local?password=***&db=1"
                    ", prefix 'asyncbus'",
                }
            },
            ["tok3n", "p4ss"],
        ),
        (
            lambda: NatsTransport("nats://s3cr3t-token@127.0.0.1:4222"),
            {
                "nats": {
                    "host": "127.0.0.1:4222",
                    "protocol": "nats",
                    "description": "NatsTransport at nats://***@127.0.0.1:4222, prefix 'asyncbus'",
                }
            },
            ["s3cr3t-token"],
        ),
        (
            lambda: RabbitTransport("amqps://guest:g0es-here@rabbit.local:5671/orders"),
            {
                "rabbit": {
                    "host": "rabbit.local:5671",
                    "protocol": "amqps",
                    "pathname": "/orders",
                    "description": "RabbitTransport at amqps://guest:***@rabbit.local:5671/orders"
                    ", prefix 'asyncbus'",
                }
            },
            ["g0es-here"],
        ),
    ],
    ids=["redis", "rediss-query", "nats-token", "amqps"],
)
def test_servers_come_from_the_transport_without_credentials(
    transport: Any, servers: dict[str, Any], secrets: list[str]
) -> None:
    bus = Bus(transport=transport())
    bus.subscribe("orders.created", lambda order: None, group="g")
    spec = document(bus)
    assert spec["servers"] == servers
    assert spec["x-asyncbus-transport"] == bus.transport.name  # type: ignore[union-attr]
    text = json.dumps(spec)
    for secret in secrets:
        assert secret not in text


class _ClusterTransport(MemoryTransport):
    """A transport given several URLs, one of them without a scheme."""

    name = "nats"

    def __init__(self, url: object) -> None:
        super().__init__()
        self.url = url


@pytest.mark.parametrize(
    "url",
    [
        "nats://a:pw@n1:4222, n2:4222,,",
        ["nats://a:pw@n1:4222", "n2:4222"],
    ],
)
def test_each_url_of_a_cluster_is_a_server(url: object) -> None:
    spec = document(Bus(transport=_ClusterTransport(url)))
    assert {name: server["host"] for name, server in spec["servers"].items()} == {
        "nats": "n1:4222",
        "nats-2": "n2:4222",
    }
    assert spec["servers"]["nats-2"]["protocol"] == "nats"
    assert "pw" not in json.dumps(spec["servers"])


def test_a_url_that_does_not_parse_is_shown_as_written_without_credentials() -> None:
    # The built-in transports refuse such a URL when created; a transport of someone
    # else's may still carry one.
    transport = RedisTransport("redis://app:hunter2@[::1]:6379/0")
    transport.url = "redis://app:hunter2@[::1:6379/0"
    bus = Bus(transport=transport)
    assert document(bus)["servers"] == {
        "redis": {
            "host": "[::1:6379",
            "protocol": "redis",
            "description": "RedisTransport at redis://***@[::1:6379/0, prefix 'asyncbus'",
        }
    }


@pytest.mark.parametrize("transport", [None, MemoryTransport(), MemoryTransport(direct=False)])
def test_a_bus_in_memory_has_no_servers(transport: MemoryTransport | None) -> None:
    spec = document(Bus(transport=transport))
    assert "servers" not in spec
    assert spec["x-asyncbus-transport"] == "memory"
