"""Fixtures for the transport tests: broker URLs that skip (or fail) when down.

(``redis_url``, ``unique_prefix`` and ``redis_prefix`` are in the top-level conftest:
the command line's tests use them too.) Each URL fixture checks that the broker's TCP
port accepts a connection within a short timeout. When it does not, the test is
skipped with a reason naming the broker, unless the environment variable
``ASYNCBUS_REQUIRE_SERVICES=1`` is set (CI): then the test fails, so a missing server
can never pass silently.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest

NATS_URL = "nats://127.0.0.1:4222"
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672/"

_CONNECT_TIMEOUT = 0.5


def _require(name: str, url: str) -> str:
    """Return ``url`` when its host:port accepts TCP, else skip (or fail in CI)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port
    assert port is not None, url
    try:
        with socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT):
            pass
    except OSError as error:
        message = f"{name} not reachable on {host}:{port} ({error})"
        if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; ASYNCBUS_REQUIRE_SERVICES=1 requires it", pytrace=False)
        pytest.skip(message)
    return url


@pytest.fixture(scope="session")
def nats_url() -> str:
    """URL of the local NATS server with JetStream (skips when it is down)."""
    return _require("NATS", NATS_URL)


@pytest.fixture(scope="session")
def rabbit_url() -> str:
    """URL of the local RabbitMQ server (skips when it is down)."""
    return _require("RabbitMQ", RABBIT_URL)


@pytest.fixture
async def nats_prefix(nats_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``; its JetStream streams (and their consumers) and its KV
    buckets are deleted after the test."""
    yield unique_prefix
    import nats
    from nats.js.errors import NotFoundError

    from asyncbus.transports.nats import NatsTransport

    with anyio.CancelScope(shield=True):
        nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
        try:
            made = NatsTransport(nats_url, prefix=unique_prefix)
            js = nc.jetstream()
            for stream in (made.stream, made.dead_letter_stream):
                with contextlib.suppress(NotFoundError):
                    await js.delete_stream(stream)
            # Its KV buckets (deduplicate() claims, hand-backs), made on demand.
            for info in await js.streams_info():
                if info.config.name.startswith(f"KV_{made.stream}_"):
                    with contextlib.suppress(NotFoundError):
                        await js.delete_stream(info.config.name)
        finally:
            await nc.close()


@pytest.fixture
async def rabbit_prefix(rabbit_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``; every queue and exchange under it is deleted after the test."""
    yield unique_prefix
    from asyncbus.transports.rabbit import RabbitTransport

    with anyio.CancelScope(shield=True):
        await RabbitTransport(rabbit_url, prefix=unique_prefix).delete_everything()


@pytest.fixture
async def postgres_prefix(postgres_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """``unique_prefix``; its schema (``-`` read as ``_``) is dropped after the test."""
    yield unique_prefix
    from _brokers import forget  # type: ignore[import-not-found]  # beside this file

    with anyio.CancelScope(shield=True):
        await forget("postgres", postgres_url, unique_prefix)


@pytest.fixture
async def postgres_schemas(
    postgres_dsn: str, unique_prefix: str
) -> AsyncIterator[Callable[[str], str]]:
    """Makes schema names of the test's own (``postgres_schemas("bus")``), each dropped
    with everything in it after the test."""
    made: list[str] = []

    def name(role: str) -> str:
        made.append(f"{unique_prefix.replace('-', '_')}_{role}")
        return made[-1]

    yield name
    import asyncpg

    with anyio.CancelScope(shield=True):
        connection = await asyncpg.connect(postgres_dsn)
        try:
            for schema in made:
                await connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        finally:
            await connection.close()


# The helpers beside this file (_private_brokers, _proxy, _brokers, the workers) are
# imported by name: pytest's importlib mode puts no test directory on sys.path by itself.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)

from _brokers import BROKERS, names  # type: ignore[import-not-found]  # noqa: E402
from _private_brokers import PrivateServer  # type: ignore[import-not-found]  # noqa: E402


@pytest.fixture(params=names())
def kind(request: pytest.FixtureRequest) -> str:
    """Each broker in turn (its shared server must be up: skips, or fails in CI)."""
    name: str = request.param
    request.getfixturevalue(f"{name}_url")
    return name


@pytest.fixture
async def url(kind: str, unique_prefix: str) -> AsyncIterator[str]:
    """The shared ``kind`` broker's URL; what the test made under ``unique_prefix`` is
    removed from it afterwards (shielded, so a cancelled test cleans up too)."""
    broker = BROKERS[kind]
    shared = broker.url()
    yield shared
    with anyio.CancelScope(shield=True):
        await broker.forget(shared, unique_prefix)


@pytest.fixture(scope="module", params=names())
async def private_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, PrivateServer]]:
    """Each broker in turn as a private server on a port of its own (for faults: a proxy
    in front of it, a stop), shared by one module's tests (prefixes keep them apart)."""
    kind: str = request.param
    folder: Path = tmp_path_factory.mktemp(kind)
    async with BROKERS[kind].start_private(folder) as running:
        yield kind, running
