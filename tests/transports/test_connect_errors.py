"""A broker that cannot be reached, or reached and not set up, fails the start with an
error naming it and its cause, and leaves no connection open and no task behind."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from _brokers import BROKERS, names  # type: ignore[import-not-found]
from _private_brokers import nats_connections, private_nats, private_redis

from asyncbus import Bus, ConnectError, TransportError
from asyncbus.transports import NatsTransport, RabbitTransport, RedisTransport

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("kind", names())
async def test_an_unreachable_broker_fails_async_with_bus_naming_host_and_port(kind: str) -> None:
    broker = BROKERS[kind]
    transport = broker.make(broker.url(1, credentials="app:s3cret"))
    with anyio.fail_after(20), pytest.raises(ConnectError) as caught:
        async with Bus(transport=transport):
            pytest.fail("the bus started without its broker")
    message = str(caught.value)
    assert "127.0.0.1:1" in message
    assert "s3cret" not in message


async def _hold(stream: anyio.abc.SocketStream) -> None:
    """A server that accepts and never says a word (a black-holed broker)."""
    async with stream:
        await anyio.sleep_forever()


@pytest.mark.parametrize("silent", [True, False], ids=["black-holed", "refused"])
async def test_nats_connect_fails_within_connect_timeout(silent: bool) -> None:
    """nats-py gives each of its attempts connect_timeout: the transport bounds them all."""
    connect_timeout = 1.0
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    transport = NatsTransport(
        f"nats://127.0.0.1:{port}", connect_timeout=connect_timeout, reconnect_wait=0.5
    )
    async with listener, anyio.create_task_group() as task_group:
        if silent:
            task_group.start_soon(listener.serve, _hold)
        else:
            await listener.aclose()  # nothing listens there any more: refused
        started = anyio.current_time()
        with anyio.fail_after(10), pytest.raises(ConnectError) as caught:
            await transport.connect()
        took = anyio.current_time() - started
        task_group.cancel_scope.cancel()
    assert took < connect_timeout + 0.3, took
    assert f"127.0.0.1:{port}" in str(caught.value)
    if silent:
        assert "connect_timeout=1" in str(caught.value)


# -- a broker reached that cannot be set up: a clear error, nothing left open ----------


def _new_tasks(before: set[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    return [task for task in asyncio.all_tasks() - before if task is not asyncio.current_task()]


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 5.0) -> None:
    """Poll ``check`` (state outside this process: the server's connections, the end of
    the tasks a client cancelled) until it holds; fail naming ``what`` otherwise."""
    try:
        with anyio.fail_after(timeout):
            while not await check():
                await anyio.sleep(0.02)
    except TimeoutError:
        pytest.fail(f"still not so after {timeout} s: {what}")


async def _no_task_left(before: set[asyncio.Task[Any]]) -> None:
    async def none_left() -> bool:
        return not _new_tasks(before)

    await _until(none_left, f"tasks left behind: {_new_tasks(before)}")


async def test_nats_without_jetstream_fails_with_connect_error_closing_its_connection(
    tmp_path: Path,
) -> None:
    async with private_nats(tmp_path, jetstream=False) as server:
        before = asyncio.all_tasks()
        transport = NatsTransport(server.url, connect_timeout=5.0, request_timeout=2.0)
        for _ in range(2):  # and again: a failed connect leaves nothing to trip over
            with anyio.fail_after(20), pytest.raises(ConnectError) as caught:
                async with Bus(transport=transport):
                    pytest.fail("the bus started without JetStream")
            message = str(caught.value)
            assert f"127.0.0.1:{server.port}" in message, message
            assert "JetStream" in message, message

            async def closed() -> bool:
                return await nats_connections(server) == 0

            await _until(closed, "the server still has the transport's connection")
            await _no_task_left(before)


async def _hold_and_record(
    accepted: list[anyio.abc.SocketStream],
    serving: set[asyncio.Task[Any]],
    stream: anyio.abc.SocketStream,
) -> None:
    """A server that accepts, records the connection and never says a word."""
    task = asyncio.current_task()
    assert task is not None
    serving.add(task)
    async with stream:
        accepted.append(stream)
        await anyio.sleep_forever()


async def _closed_by_peer(stream: anyio.abc.SocketStream) -> bool:
    try:
        while True:
            await stream.receive()  # what the client said while it connected
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        return True


@pytest.mark.parametrize("kind", names())
async def test_a_connect_cancelled_midway_closes_its_socket_and_leaves_no_task(kind: str) -> None:
    broker = BROKERS[kind]
    accepted: list[anyio.abc.SocketStream] = []
    serving: set[asyncio.Task[Any]] = set()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as task_group:
        task_group.start_soon(
            listener.serve, functools.partial(_hold_and_record, accepted, serving)
        )
        await anyio.wait_all_tasks_blocked()
        before = asyncio.all_tasks()
        transport = broker.make(broker.url(port), **broker.patient_connect)
        with anyio.move_on_after(0.5) as scope:
            await transport.connect()  # a server that accepts and never answers
        assert scope.cancelled_caught
        assert accepted, "the transport never reached the server"
        with anyio.fail_after(5):
            for stream in accepted:
                assert await _closed_by_peer(stream)
        await _no_task_left(before | serving)
        task_group.cancel_scope.cancel()


@pytest.mark.parametrize("kind", names())
async def test_a_black_holed_broker_fails_the_start_saying_why(kind: str) -> None:
    broker = BROKERS[kind]
    """A server that accepts and never answers: the error ends with its cause."""
    accepted: list[anyio.abc.SocketStream] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as task_group:
        task_group.start_soon(listener.serve, functools.partial(_hold_and_record, accepted, set()))
        with anyio.fail_after(30), pytest.raises(ConnectError) as caught:
            async with Bus(transport=broker.make(broker.url(port))):
                pytest.fail("the bus started without an answer from its broker")
        task_group.cancel_scope.cancel()
    message = str(caught.value)
    where, _, reason = message.partition(f"127.0.0.1:{port}")
    assert where, message
    assert reason.rstrip(" :)/"), f"no cause given: {message!r}"
    assert not message.rstrip().endswith(":"), f"no cause given: {message!r}"


async def _redis_clients(url: str) -> int:
    import redis.asyncio as aioredis

    admin = aioredis.Redis.from_url(url)
    try:
        info = await admin.info("clients")
    finally:
        await admin.aclose()
    return int(info["connected_clients"]) - 1  # less this one


@pytest.mark.parametrize(
    ("denied", "error"),
    [("-ping", ConnectError), ("-xtrim", TransportError)],
    ids=["at-connect", "after-connect"],
)
async def test_redis_refusing_a_set_up_command_fails_the_start_naming_the_server(
    tmp_path: Path, denied: str, error: type[Exception]
) -> None:
    """An ACL user that may not run a command the start needs: PING (the transport's
    connect), XTRIM (the bus reading the stored dead letters once connected)."""
    import redis.asyncio as aioredis

    async with private_redis(tmp_path) as server:
        admin = aioredis.Redis.from_url(server.url)
        await admin.execute_command("ACL", "SETUSER", "app", "on", ">s3cret", "~*", "&*", "+@all")
        await admin.execute_command("ACL", "SETUSER", "app", denied)
        await admin.aclose()
        before = asyncio.all_tasks()
        url = f"redis://app:s3cret@127.0.0.1:{server.port}/0"
        bus = Bus(transport=RedisTransport(url, publish_timeout=3.0))
        with anyio.fail_after(20), pytest.raises(error) as caught:
            async with bus:
                pytest.fail("the bus started without a command it needs")
        message = str(caught.value)
        assert f"127.0.0.1:{server.port}" in message, message
        assert denied[1:] in message, message  # the cause: the command refused
        assert "s3cret" not in message

        async def closed() -> bool:
            return await _redis_clients(server.url) == 0

        await _until(closed, "the transport's connections are still open")
        await _no_task_left(before)


RABBITMQCTL = shutil.which("rabbitmqctl")


async def _rabbitmqctl(*arguments: str) -> str:
    assert RABBITMQCTL is not None
    done = await anyio.run_process([RABBITMQCTL, "-q", *arguments], check=True)
    return done.stdout.decode()


@pytest.fixture
async def rabbit_vhost(rabbit_url: str, unique_prefix: str) -> AsyncIterator[str]:
    """A vhost and a user (password ``s3cret``) of the test's own on the shared RabbitMQ,
    both named ``unique_prefix``, the user without any permission yet; deleted after."""
    if RABBITMQCTL is None:
        pytest.skip("rabbitmqctl is not available")
    try:
        await _rabbitmqctl("add_vhost", unique_prefix)
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"rabbitmqctl cannot manage the broker here: {error}")
    try:
        await _rabbitmqctl("add_user", unique_prefix, "s3cret")
        yield unique_prefix
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(subprocess.CalledProcessError):
                await _rabbitmqctl("delete_user", unique_prefix)
            await _rabbitmqctl("delete_vhost", unique_prefix)


@pytest.mark.parametrize(
    ("configure", "error"),
    [
        # No name may be declared: the transport's own exchange is refused.
        ("^$", ConnectError),
        # All but the dead-letter lock: the bus's reading of the dead letters fails.
        (r"^(p|p\.deadletters|p\.catalog|p\.groups.*|amq\.gen.*)$", TransportError),
    ],
    ids=["at-connect", "after-connect"],
)
async def test_rabbit_refusing_a_declaration_fails_the_start_naming_the_broker(
    rabbit_vhost: str, configure: str, error: type[Exception]
) -> None:
    await _rabbitmqctl("set_permissions", "-p", rabbit_vhost, rabbit_vhost, configure, ".*", ".*")
    before = asyncio.all_tasks()
    url = f"amqp://{rabbit_vhost}:s3cret@127.0.0.1:5672/{rabbit_vhost}"
    bus = Bus(transport=RabbitTransport(url, prefix="p", publish_timeout=5.0))
    with anyio.fail_after(30), pytest.raises(error) as caught:
        async with bus:
            pytest.fail("the bus started without the right to declare its names")
    message = str(caught.value)
    assert "127.0.0.1:5672" in message, message
    assert "ACCESS_REFUSED" in message, message
    assert "s3cret" not in message

    async def closed() -> bool:
        listed = await _rabbitmqctl("list_connections", "--no-table-headers", "user")
        return rabbit_vhost not in listed.split()

    await _until(closed, "the transport's connections are still open", timeout=15)
    await _no_task_left(before)
