"""What a bus leaves in the broker, and how fast it consumes again after a cut.

A requester's reply inbox (Redis: a stream and its binding; NATS: a durable consumer)
is removed when its bus closes, and expires when its process dies without closing.
NATS asks for messages again as soon as a cut connection is back, instead of waiting
for its old pull request to expire.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from _private_brokers import nats_connections, private_nats
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

from asyncbus import Bus, Envelope
from asyncbus.transports.nats import NatsTransport
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

WORKER = Path(__file__).with_name("_requester_worker.py")
#: Seconds an inbox of a dead process lasts in these tests (300 by default).
INBOX_TTL = 1.0


def _answering(bus: Bus) -> None:
    @bus.subscribe("ask", group="answers")
    async def answer(n: int) -> int:
        return n + 1


# -- Redis ------------------------------------------------------------------------------


async def _redis_inbox_keys(url: str, prefix: str) -> dict[str, Any]:
    """Everything the prefix holds in Redis about request inboxes."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        streams = [key async for key in client.scan_iter(match=f"{prefix}:stage:_reply*")]
        bindings = [k for k in await client.hkeys(f"{prefix}:bindings") if b"_reply" in k]
        expiries = await client.zrange(f"{prefix}:inboxes", 0, -1)
    finally:
        await client.aclose()
    return {"streams": streams, "bindings": bindings, "expiries": expiries}


NONE_LEFT = {"streams": [], "bindings": [], "expiries": []}


async def test_redis_inbox_is_removed_when_its_bus_closes(
    redis_url: str, redis_prefix: str
) -> None:
    answers = Bus(transport=RedisTransport(redis_url, prefix=redis_prefix))
    _answering(answers)
    async with answers:
        for _ in range(2):  # two requester processes, one after the other
            requester = Bus(transport=RedisTransport(redis_url, prefix=redis_prefix))
            async with requester:
                assert await requester.request("ask", 1, timeout=10) == 2
                found = await _redis_inbox_keys(redis_url, redis_prefix)
                assert [len(found[kind]) for kind in NONE_LEFT] == [1, 1, 1]
            assert await _redis_inbox_keys(redis_url, redis_prefix) == NONE_LEFT


# -- NATS -------------------------------------------------------------------------------


async def _nats_inbox_consumers(url: str, transport: NatsTransport) -> list[str]:
    import nats

    nc = await nats.connect(url, allow_reconnect=False)
    try:
        infos = await nc.jetstream().consumers_info(transport.stream)
    finally:
        await nc.close()
    return [info.name for info in infos if info.name.startswith("_reply")]


async def test_nats_inbox_is_removed_when_its_bus_closes(nats_url: str, nats_prefix: str) -> None:
    answers = Bus(transport=NatsTransport(nats_url, prefix=nats_prefix))
    _answering(answers)
    async with answers:
        transport = answers.transport
        assert isinstance(transport, NatsTransport)
        for _ in range(2):
            requester = Bus(transport=NatsTransport(nats_url, prefix=nats_prefix))
            async with requester:
                assert await requester.request("ask", 1, timeout=10) == 2
                assert len(await _nats_inbox_consumers(nats_url, transport)) == 1
            assert await _nats_inbox_consumers(nats_url, transport) == []


# -- a requester that dies --------------------------------------------------------------


class _Requester:
    """A ``_requester_worker.py`` process: it asks once, tells the answer, then waits."""

    def __init__(self, process: Process) -> None:
        self.process = process
        assert process.stdout is not None
        self._lines = BufferedByteReceiveStream(process.stdout)

    async def line(self, timeout: float = 30.0) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            data = await self._lines.receive_until(b"\n", 1 << 16)
        found: dict[str, Any] = json.loads(data)
        return found


@pytest.fixture
async def requester() -> AsyncIterator[list[_Requester]]:
    """Requester processes of the test; killed (if still alive) and reaped after it."""
    started: list[_Requester] = []
    yield started
    with anyio.CancelScope(shield=True), anyio.fail_after(10):
        for worker in started:
            if worker.process.returncode is None:
                worker.process.kill()
            await worker.process.wait()
            await worker.process.aclose()


async def _kill_a_requester(kind: str, url: str, prefix: str, started: list[_Requester]) -> None:
    """Start a requester process, let it get its answer, then ``kill -9`` it."""
    process = await anyio.open_process(
        [sys.executable, str(WORKER), kind, url, prefix, str(INBOX_TTL)],
        stdout=subprocess.PIPE,
        stderr=None,
    )
    worker = _Requester(process)
    started.append(worker)
    assert await worker.line() == {"answer": 2}
    worker.process.kill()
    await worker.process.wait()


async def test_redis_inbox_of_a_killed_process_expires(
    redis_url: str, redis_prefix: str, requester: list[_Requester]
) -> None:
    transport = RedisTransport(redis_url, prefix=redis_prefix)
    transport.inbox_ttl = INBOX_TTL  # this live process is the one that cleans up
    answers = Bus(transport=transport)
    _answering(answers)
    async with answers:
        await _kill_a_requester("redis", redis_url, redis_prefix, requester)
        found = await _redis_inbox_keys(redis_url, redis_prefix)
        assert [len(found[kind]) for kind in NONE_LEFT] == [1, 1, 1]
        with anyio.fail_after(INBOX_TTL * 10):
            while await _redis_inbox_keys(redis_url, redis_prefix) != NONE_LEFT:
                await anyio.sleep(0.1)


async def test_nats_inbox_of_a_killed_process_expires(
    nats_url: str, nats_prefix: str, requester: list[_Requester]
) -> None:
    answers = Bus(transport=NatsTransport(nats_url, prefix=nats_prefix))
    _answering(answers)
    async with answers:
        transport = answers.transport
        assert isinstance(transport, NatsTransport)
        await _kill_a_requester("nats", nats_url, nats_prefix, requester)
        assert len(await _nats_inbox_consumers(nats_url, transport)) == 1
        with anyio.fail_after(INBOX_TTL * 10):
            while await _nats_inbox_consumers(nats_url, transport):
                await anyio.sleep(0.1)


# -- NATS after a cut connection -------------------------------------------------------


class _Cutter:
    """A loopback TCP relay to a server whose connections the test can cut.

    ``cut(down)`` closes every relayed connection and stops listening for ``down``
    seconds (connections are refused), as a network that drops and comes back.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._listening = anyio.CancelScope()
        self._down = 0.0
        self._closed = anyio.Event()

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        started = False
        while True:
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=self.port)
            self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
            with anyio.CancelScope() as self._listening:
                if not started:
                    started = True
                    task_status.started()
                async with listener:
                    await listener.serve(self._relay)  # relays end with it
            self._closed.set()
            await anyio.sleep(self._down)

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        async with (
            client,
            await anyio.connect_tcp("127.0.0.1", self.target_port) as server,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(self._pump, client, server, tg.cancel_scope)
            tg.start_soon(self._pump, server, client, tg.cancel_scope)

    @staticmethod
    async def _pump(
        source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream, scope: anyio.CancelScope
    ) -> None:
        try:
            async for data in source:
                await sink.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        scope.cancel()

    async def cut(self, down: float) -> None:
        """Close every connection (both ends, before this returns); refuse new ones."""
        self._down = down
        self._closed = anyio.Event()
        self._listening.cancel()
        await self._closed.wait()


async def test_nats_consumes_again_at_once_after_a_cut_connection(tmp_path: Path) -> None:
    """Messages published while the connection is down reach the consumer as soon as it
    is back, not when its old pull request (dropped by the server) would have expired."""
    async with private_nats(tmp_path) as server, anyio.create_task_group() as relays:
        cutter = _Cutter(server.port)
        await relays.start(cutter.serve)
        transport = NatsTransport(
            f"nats://127.0.0.1:{cutter.port}", prefix="cut", reconnect_wait=0.2
        )
        bus = Bus(transport=transport)
        handled: dict[int, float] = {}

        @bus.subscribe("work", group="g")
        async def handle(n: int) -> None:
            handled[n] = time.monotonic()

        async with (
            bus,
            NatsTransport(server.url, prefix="cut") as publisher,
        ):
            await bus.publish("work", 0)
            await bus.drain()  # a new pull request is open from here on
            assert transport._connection.nc is not None
            reconnects = transport._connection.nc.stats["reconnects"]
            connected = await nats_connections(server)
            await cutter.cut(down=1.0)
            # While it is away, the server finds no interest for the open pull request
            # when this arrives: it drops the request and keeps the message. (Once the
            # server has seen the connection go: a message sent into the request before
            # that would be lost with it until ack_wait, whatever the client does.)
            with anyio.fail_after(5):
                while await nats_connections(server) >= connected:
                    await anyio.sleep(0.01)
            await publisher.publish("work", [Envelope(topic="work", payload=1)])
            with anyio.fail_after(10):
                while transport._connection.nc.stats["reconnects"] == reconnects:
                    await anyio.sleep(0.01)
            back = time.monotonic()
            with anyio.fail_after(15):
                while 1 not in handled:
                    await anyio.sleep(0.01)
        relays.cancel_scope.cancel()
    waited = handled[1] - back
    # An old pull request would hold it for about 5 s (its expiry); a loaded machine may
    # take a second or two to reconnect and ask again.
    assert waited < 3.0, f"handled {waited:.2f} s after the connection was back"
