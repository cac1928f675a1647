"""The brokers the suite runs against: one row each in :data:`BROKERS`.

Every test that runs a case on each broker takes its list from here (``names()``, or
``names("heartbeats")`` for the brokers with a feature), builds its transport with
``make_transport`` and cleans up with ``forget``; the worker scripts beside this file
do the same. A new broker is one row: its shared server's port, URL, transport class,
client library, the features it offers, how to remove what a test left in it, and how
to start a private server of it for the fault tests (``_private_brokers``).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncbus.transports import Transport

__all__ = [
    "BROKERS",
    "SHARED_PORTS",
    "Broker",
    "forget",
    "make_transport",
    "names",
    "publish_verbatim",
    "url_for",
]


@dataclass(frozen=True)
class Broker:
    """One broker: what the tests need to know to run a case on it."""

    #: The id tests are parametrised by.
    name: str
    #: Its name in messages ("RabbitMQ").
    title: str
    #: Its shared loopback server's port.
    port: int
    #: The URL of a server on 127.0.0.1 (``{port}``; ``{auth}``: ``user:password@`` or "").
    url_template: str
    #: The credentials of the shared server (``user:password``), or "".
    credentials: str
    #: ``module:Class`` of its transport.
    transport: str
    #: Its extra in pyproject.toml, and the client modules that extra brings.
    extra: str
    client_modules: tuple[str, ...]
    #: The client library named in the transport's "asyncio only" error.
    client: str
    #: OpenTelemetry's ``messaging.system`` for it.
    messaging_system: str
    #: What only some brokers offer: ``dedup_store`` (deduplicate()'s claims kept in
    #: the broker), ``rate_store`` (RateLimit's turns kept there), ``lease_store``
    #: (max_in_flight's slots kept there), ``heartbeats`` (the deployment view),
    #: ``quick_restart`` (a private server of it restarts within a second or two).
    features: frozenset[str]
    #: Removes what a test made under a prefix: ``await forget(url, prefix)``.
    forget: Callable[[str, str], Awaitable[None]]
    #: The ``_private_brokers`` function that starts a private server of it.
    private: str
    #: Options that keep a connect waiting on a silent server past the tests' cut-off.
    patient_connect: dict[str, Any] = field(default_factory=dict)
    #: Options of its private server that keep every confirmed write on disk across a
    #: kill (a broker that always does needs none).
    durable_private: dict[str, Any] = field(default_factory=dict)
    #: The constructor keyword that takes the test's prefix (PostgreSQL: ``schema``,
    #: which takes ``_`` where a prefix has ``-``).
    namespace: str = "prefix"

    def url(self, port: int | None = None, *, credentials: str | None = None) -> str:
        """The URL of this broker on 127.0.0.1:``port`` (default: the shared server)."""
        given = self.credentials if credentials is None else credentials
        return self.url_template.format(
            port=self.port if port is None else port, auth=f"{given}@" if given else ""
        )

    def namespaced(self, prefix: str) -> str:
        """``prefix`` as this broker's transport takes it."""
        return prefix.replace("-", "_") if self.namespace == "schema" else prefix

    def transport_class(self) -> type[Transport]:
        """Its transport class (the client library is imported then, not before)."""
        module, _, name = self.transport.partition(":")
        found: type[Transport] = getattr(importlib.import_module(module), name)
        return found

    def make(self, url: str, prefix: str | None = None, **options: Any) -> Transport:
        """Its transport on ``url`` (under ``prefix``), with the given options."""
        if prefix is not None:
            options[self.namespace] = self.namespaced(prefix)
        return self.transport_class()(url, **options)  # type: ignore[arg-type, call-arg]

    def start_private(self, directory: Path, *, durable: bool = False) -> Any:
        """A private server of this broker in ``directory`` (an async context manager);
        ``durable``: one that keeps every confirmed write across a kill."""
        import _private_brokers  # type: ignore[import-not-found]  # beside this file

        options = self.durable_private if durable else {}
        return getattr(_private_brokers, self.private)(directory, **options)


async def _forget_redis(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


async def _forget_nats(url: str, prefix: str) -> None:
    import nats
    import nats.js.errors

    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        js = client.jetstream()
        mine = prefix.upper()
        for info in await js.streams_info():
            if info.config.name.startswith((mine, f"KV_{mine}")):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(info.config.name)
    finally:
        await client.close()


async def _forget_rabbit(url: str, prefix: str) -> None:
    from asyncbus.transports.rabbit import RabbitTransport

    await RabbitTransport(url, prefix=prefix).delete_everything()


async def _forget_postgres(url: str, prefix: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url, timeout=5)
    try:
        await connection.execute(f"DROP SCHEMA IF EXISTS {prefix.replace('-', '_')} CASCADE")
    finally:
        await connection.close()


#: Every broker the suite knows, by name.
BROKERS: dict[str, Broker] = {
    broker.name: broker
    for broker in (
        Broker(
            name="redis",
            title="Redis",
            port=6379,
            url_template="redis://{auth}127.0.0.1:{port}/0",
            credentials="",
            transport="asyncbus.transports.redis:RedisTransport",
            extra="redis",
            client_modules=("redis",),
            client="redis-py",
            messaging_system="redis",
            features=frozenset(
                {"dedup_store", "rate_store", "lease_store", "heartbeats", "quick_restart"}
            ),
            forget=_forget_redis,
            private="private_redis",
            durable_private={"persistent": True},
        ),
        Broker(
            name="nats",
            title="NATS",
            port=4222,
            url_template="nats://{auth}127.0.0.1:{port}",
            credentials="",
            transport="asyncbus.transports.nats:NatsTransport",
            extra="nats",
            client_modules=("nats",),
            client="nats-py",
            messaging_system="nats",
            features=frozenset(
                {"dedup_store", "rate_store", "lease_store", "heartbeats", "quick_restart"}
            ),
            forget=_forget_nats,
            private="private_nats",
            patient_connect={"connect_timeout": 5.0},
        ),
        Broker(
            name="rabbit",
            title="RabbitMQ",
            port=5672,
            url_template="amqp://{auth}127.0.0.1:{port}/",
            credentials="guest:guest",
            transport="asyncbus.transports.rabbit:RabbitTransport",
            extra="rabbit",
            client_modules=("aio_pika", "aiormq", "pamqp"),
            client="aiormq",
            messaging_system="rabbitmq",
            features=frozenset(),
            forget=_forget_rabbit,
            private="private_rabbit",
        ),
        Broker(
            name="postgres",
            title="PostgreSQL",
            port=5432,
            # (No TLS on loopback: asyncpg's TLS probe, cut off by a fault test, leaves a
            # future whose error nobody reads, which the test runner reports.)
            url_template="postgresql://{auth}127.0.0.1:{port}/test?sslmode=disable",
            credentials="postgres",
            transport="asyncbus.transports.postgres:PostgresTransport",
            extra="postgres",
            client_modules=("asyncpg",),
            client="asyncpg",
            messaging_system="postgresql",
            features=frozenset(
                {"dedup_store", "rate_store", "lease_store", "heartbeats", "quick_restart"}
            ),
            forget=_forget_postgres,
            private="private_postgres",
            namespace="schema",
        ),
    )
}

#: Ports of the shared loopback brokers.
SHARED_PORTS = {name: broker.port for name, broker in BROKERS.items()}


def names(*features: str) -> list[str]:
    """The brokers that offer every one of ``features`` (none given: all of them)."""
    return [name for name, broker in BROKERS.items() if broker.features >= set(features)]


def url_for(kind: str, port: int) -> str:
    """The URL of a ``kind`` broker listening on 127.0.0.1:``port``."""
    return BROKERS[kind].url(port)


def make_transport(kind: str, url: str, prefix: str, **options: Any) -> Transport:
    """A ``kind`` transport on ``url`` under ``prefix``, with the given constructor options."""
    return BROKERS[kind].make(url, prefix, **options)


async def forget(kind: str, url: str, prefix: str) -> None:
    """Delete everything a test left in the broker under ``prefix``."""
    await BROKERS[kind].forget(url, prefix)


async def publish_verbatim(transport: Transport, topic: str, body: bytes) -> None:
    """Publish one envelope to ``topic`` through ``transport`` with a codec that writes
    ``body`` as it is (a conformance suite's ``publish_raw``, on a broker whose
    transport has no other way to write a raw body)."""
    from asyncbus import Envelope

    class Verbatim:
        content_type = "application/octet-stream"

        def encode(self, value: Any) -> bytes:
            return body

        def decode(self, data: bytes) -> Any:
            return data

    codec, transport.codec = transport.codec, Verbatim()
    try:
        await transport.publish(topic, [Envelope(topic=topic, payload=None)])
    finally:
        transport.codec = codec
