"""The broker transports asyncbus ships, one row each: the only list of them.

A row names a transport (``redis``), where its class lives (imported only when asked
for, so its client library is too), and the URL schemes it takes with the AsyncAPI
protocol of each. Everything that needs a broker by name or by URL reads this table:
the lazy ``from asyncbus.transports import RedisTransport``, the command line's
``--url`` (:func:`by_scheme`), each transport's own URL check, the check that
refuses another broker's URL, and the AsyncAPI document's servers. Adding a transport
is its module and one row here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TRANSPORTS",
    "Registered",
    "by_scheme",
    "lazy_classes",
    "registered",
    "registered_schemes",
]


@dataclass(frozen=True, slots=True)
class Registered:
    """One broker transport asyncbus ships.

    :ivar name: its short name (the transport's ``name``; extras, servers, logs).
    :ivar module: the module its class lives in, relative to ``asyncbus.transports``.
    :ivar cls: its class's name, exported lazily from ``asyncbus.transports``.
    :ivar schemes: the URL schemes it takes, first the plain one, each with its
        AsyncAPI protocol.
    :ivar namespace: the keyword of its constructor that keeps one deployment's names
        apart from another's on the same broker (``prefix``; PostgreSQL's ``schema``).
    :ivar cluster: whether its class takes ``cluster=True`` (a cluster of its broker is
        spoken to otherwise than one server; the command line's ``--cluster``). A
        transport without it takes a cluster's nodes as several URLs alone.
    """

    name: str
    module: str
    cls: str
    schemes: Mapping[str, str]
    namespace: str = "prefix"
    cluster: bool = False

    @property
    def default_scheme(self) -> str:
        """The scheme a URL written without one stands for."""
        return next(iter(self.schemes))

    def load(self) -> Callable[..., Any]:
        """Its class (importing its module; the client library is imported when made).

        (Typed loosely: this table sits below the contract, which the kit imports.)
        """
        found: Callable[..., Any] = getattr(
            importlib.import_module(self.module, "asyncbus.transports"), self.cls
        )
        return found


#: Every broker transport, in the order they are offered.
TRANSPORTS: tuple[Registered, ...] = (
    Registered(
        "redis",
        ".redis",
        "RedisTransport",
        {"redis": "redis", "rediss": "redis", "unix": "redis"},
        cluster=True,
    ),
    Registered(
        "nats", ".nats", "NatsTransport", {"nats": "nats", "tls": "nats", "ws": "ws", "wss": "wss"}
    ),
    Registered("rabbit", ".rabbit", "RabbitTransport", {"amqp": "amqp", "amqps": "amqps"}),
    Registered(
        "postgres",
        ".postgres",
        "PostgresTransport",
        {"postgresql": "postgresql", "postgres": "postgresql"},
        namespace="schema",
    ),
)


def registered(name: str) -> Registered:
    """The row of the transport called ``name``."""
    for row in TRANSPORTS:
        if row.name == name:
            return row
    raise KeyError(name)


def lazy_classes() -> dict[str, str]:
    """Each transport class's name and the module it lives in."""
    return {row.cls: row.module for row in TRANSPORTS}


def registered_schemes() -> frozenset[str]:
    """Every URL scheme some transport takes."""
    return frozenset(scheme for row in TRANSPORTS for scheme in row.schemes)


def by_scheme(scheme: str) -> Registered | None:
    """The transport that takes URLs of ``scheme`` (any case), ``None`` when none does."""
    scheme = scheme.lower()
    for row in TRANSPORTS:
        if scheme in row.schemes:
            return row
    return None
