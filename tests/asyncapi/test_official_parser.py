"""The documents ``asyncbus.asyncapi.document`` makes pass the official AsyncAPI parser.

``@asyncapi/parser`` (from the npm registry, pinned in package.json beside this file)
runs under the machine's Node.js: ``(cd tests/asyncapi && npm ci)`` installs it, and CI
does. Without Node.js or the parser the tests are skipped, unless the environment sets
``ASYNCBUS_REQUIRE_SERVICES=1`` (as CI does): then they fail.

Every document is written to a file and all are validated by one run of
``validate.mjs``: the examples' buses (each example made in a subprocess, as a user
runs it, so one example's global set-up cannot leak into this process) and buses
made here with every kind of payload, pattern and transport.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

import msgspec
import pydantic
import pytest

from asyncbus import DEADLETTER_TOPIC, Batch, Bus, DeadLetter, Envelope
from asyncbus.asyncapi import document
from asyncbus.transports import MemoryTransport, NatsTransport, RabbitTransport, RedisTransport

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VALIDATE = HERE / "validate.mjs"
PARSER = HERE / "node_modules" / "@asyncapi" / "parser" / "package.json"
EXAMPLES = sorted(path.stem for path in (ROOT / "examples").glob("*.py"))
#: How an example's bus is had, when it is not the module's ``bus``.
EXAMPLE_BUSES = {"scaled_out_redis": "worker_bus('worker-1', 'asyncbus-example', lambda: None)"}

#: Writes the document of every example's bus into the folder it is given.
MAKE_EXAMPLE_DOCUMENTS = """
import importlib.util, json, sys
from pathlib import Path
from asyncbus.asyncapi import document

examples, out, how = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
for path in sorted(examples.glob("*.py")):
    name = "asyncapi_example_" + path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    bus = eval(how.get(path.stem, "bus"), vars(module))
    spec = document(bus, title=path.stem, version="1.0.0")
    (out / ("example-" + path.stem + ".json")).write_text(json.dumps(spec, allow_nan=False))
"""


# -- buses of every kind ----------------------------------------------------------------


@dataclasses.dataclass
class Order:
    """An order."""

    id: int
    item: str
    quantity: int = 1
    tags: list[str] = dataclasses.field(default_factory=list)
    placed: datetime.datetime | None = None


@dataclasses.dataclass
class Tree:
    value: int
    children: list[Tree] = dataclasses.field(default_factory=list)


class Colour(enum.Enum):
    RED = "red"
    GREEN = "green"


class Point(TypedDict):
    x: float
    y: float
    label: NotRequired[str]


class Item(msgspec.Struct):
    sku: str
    quantity: int = 1


class Card(msgspec.Struct, tag="card"):
    number: str


class Cash(msgspec.Struct, tag="cash"):
    amount: float


class Payment(msgspec.Struct):
    items: list[Item]
    method: Card | Cash
    raw: bytes = b""


class Customer(pydantic.BaseModel):
    name: str
    location: tuple[float, float]
    colour: Colour = Colour.RED


class Line(pydantic.BaseModel):
    sku: str
    price: float = pydantic.Field(ge=0)


class Invoice(pydantic.BaseModel):
    customer: Customer
    lines: list[Line | None]
    kind: Literal["a", "b"] = "a"


def on(bus: Bus, topic: str, annotation: Any, *, batch: bool = False, group: str = "") -> None:
    """Subscribe a handler whose payload is annotated ``annotation`` (``None``: bare)."""

    async def handler(payload):  # type: ignore[no-untyped-def]
        """Handle what comes, and say so in the document."""

    if annotation is not None:
        handler.__annotations__ = {"payload": annotation, "return": None}
    bus.subscribe(
        topic,
        handler,
        group=group or f"g-{topic}",
        batch=Batch(max_size=10) if batch else None,
    )


def every_payload_kind() -> Bus:
    bus = Bus(name="kinds")
    kinds: list[Any] = [
        Order, Tree, Point, Item, Payment, Customer, Invoice, Colour, Envelope, None,
        dict, int, str, float, bool, bytes, list, list[int], dict[str, float], set[str],
        tuple[int, str], tuple[int, ...], int | None, Literal["x", 1], datetime.date,
        uuid.UUID, Mapping[str, Any], Any,
    ]  # fmt: skip
    for number, annotation in enumerate(kinds):
        on(bus, f"kinds.k{number}", annotation)
    on(bus, "batches.orders", list[Order], batch=True)
    on(bus, "batches.envelopes", list[Envelope], batch=True)
    on(bus, "batches.bare", None, batch=True)
    on(bus, "shared", Order, group="workers")
    on(bus, "shared", Item, group="workers")
    on(bus, "shared", Envelope, group="workers")
    on(bus, DEADLETTER_TOPIC, DeadLetter)
    return bus


def patterns() -> Bus:
    bus = Bus(name="patterns")
    for pattern in ("orders.*", "orders.*.shipped", "audit.>", ">", "*.*.>", "orders.{id}"):
        on(bus, pattern, Order)
    on(bus, "orders.any", Order)  # reads like orders.* as a channel id
    return bus


def two_types_of_one_name() -> Bus:
    @dataclasses.dataclass
    class Item:  # not the module's
        code: int

    bus = Bus()
    on(bus, "a", Item)
    on(bus, "b", Payment)  # refers to the module's Item
    return bus


def over(transport: Callable[[], Any]) -> Callable[[], Bus]:
    def make() -> Bus:
        bus = Bus(transport=transport())
        on(bus, "orders.created", Order)
        on(bus, "orders.*", Envelope)
        return bus

    return make


def publications() -> dict[str, Any]:
    bus = Bus(name="publisher")
    on(bus, "orders.created", Order)
    spec = {"orders.created": Order, "orders.cancelled": None, "metrics.>": dict[str, float]}
    return document(bus, title="Publisher", version="2.0.0", publications=spec)


DOCUMENTS: dict[str, Callable[[], dict[str, Any]]] = {
    "empty": lambda: document(Bus()),
    "every-payload-kind": lambda: document(every_payload_kind(), description="All *kinds*."),
    "patterns": lambda: document(patterns()),
    "two-types-of-one-name": lambda: document(two_types_of_one_name()),
    "publications": publications,
    "redis": lambda: document(
        over(lambda: RedisTransport("redis://app:s3cret@127.0.0.1:6379/2", prefix="shop"))()
    ),
    "rediss-query-secret": lambda: document(
        over(lambda: RedisTransport("rediss://127.0.0.1?password=s3cret"))()
    ),
    "nats-token": lambda: document(over(lambda: NatsTransport("nats://t0ken@127.0.0.1:4222"))()),
    "rabbit": lambda: document(
        over(lambda: RabbitTransport("amqps://guest:s3cret@127.0.0.1:5671/vhost"))()
    ),
    "memory-broker-path": lambda: document(over(lambda: MemoryTransport(direct=False))()),
}

#: A document the parser must refuse: an OpenAPI-style discriminator object.
BROKEN = {
    "asyncapi": "3.0.0",
    "info": {"title": "broken", "version": "1"},
    "channels": {
        "c": {
            "address": "c",
            "messages": {"m": {"payload": {"type": "object", "discriminator": {"x": 1}}}},
        }
    },
}


# -- the parser -------------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (ASYNCBUS_REQUIRE_SERVICES=1: the parser must run)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Document name -> the parser's verdict: ``{"valid": bool, "diagnostics": [...]}``."""
    node = shutil.which("node")
    if node is None:
        _unavailable("Node.js is not installed (apt-get install nodejs npm)")
    if not PARSER.is_file():
        _unavailable("the AsyncAPI parser is not installed: (cd tests/asyncapi && npm ci)")
    folder = tmp_path_factory.mktemp("asyncapi")
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            MAKE_EXAMPLE_DOCUMENTS,
            str(ROOT / "examples"),
            str(folder),
            json.dumps(EXAMPLE_BUSES),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (made.returncode, made.stderr) == (0, ""), made.stderr
    for name, make in {**DOCUMENTS, "broken": lambda: BROKEN}.items():
        (folder / f"{name}.json").write_text(json.dumps(make(), allow_nan=False))
    files = sorted(folder.glob("*.json"))
    assert node is not None
    parsed = subprocess.run(
        [node, str(VALIDATE), "--json", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert parsed.returncode == 1, parsed.stdout + parsed.stderr  # "broken" is refused
    by_file = json.loads(parsed.stdout)
    return {Path(file).stem: verdict for file, verdict in by_file.items()}


def problems(verdict: dict[str, Any]) -> list[dict[str, Any]]:
    """The errors and warnings (information and hints, such as "3.1.0 exists", are not)."""
    return [d for d in verdict["diagnostics"] if d["severity"] in ("error", "warning")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", EXAMPLES)
def test_the_document_of_each_example_is_valid(
    example: str, verdicts: dict[str, dict[str, Any]]
) -> None:
    verdict = verdicts[f"example-{example}"]
    assert (verdict["valid"], problems(verdict)) == (True, [])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(DOCUMENTS))
def test_the_documents_of_buses_of_every_kind_are_valid(
    name: str, verdicts: dict[str, dict[str, Any]]
) -> None:
    verdict = verdicts[name]
    assert (verdict["valid"], problems(verdict)) == (True, [])


@pytest.mark.timeout(300)
def test_the_parser_refuses_what_is_not_valid(verdicts: dict[str, dict[str, Any]]) -> None:
    verdict = verdicts["broken"]
    assert verdict["valid"] is False
    assert {
        "severity": "error",
        "code": "asyncapi-document-resolved",
        "message": '"discriminator" property type must be string',
        "path": "channels.c.messages.m.payload.discriminator",
    } in verdict["diagnostics"]
