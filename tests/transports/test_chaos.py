"""Chaos, one run per broker: nothing confirmed is ever lost, whatever breaks.

Each run owns a private broker (``_private_brokers``) with persistence on, a TCP
proxy in front of it (``_proxy``), and two consumer processes of one group
(``_bus_worker.py``), one through the proxy and one direct. While this process
publishes a steady stream through the proxy, the run:

1. kills one consumer process (SIGKILL) and starts a replacement;
2. cuts every connection through the proxy;
3. black-holes the proxy for a few seconds, then heals it;
4. kills the broker (SIGKILL) and starts it again on its data.

Then it waits until every confirmed publish was handled and reports exact counts:
confirmed (``publish`` returned), delivered (confirmed and handled at least once),
duplicated (handlings beyond the first), lost (confirmed and never handled), and the
publishes that failed (``TransportError``: not confirmed, so not owed). Lost must be 0.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest
from _brokers import BROKERS, make_transport, names, url_for  # type: ignore[import-not-found]
from _private_brokers import PrivateServer  # type: ignore[import-not-found]
from _proxy import TcpProxy  # type: ignore[import-not-found]

from asyncbus import Bus, TransportError

pytestmark = [pytest.mark.anyio, pytest.mark.chaos]

WORKER = Path(__file__).with_name("_bus_worker.py")
#: Seconds between two publishes of the steady stream.
PACE = 0.01
PUBLISH_TIMEOUT = 3.0


class Consumer:
    """A consumer process (``_bus_worker.py``) and the file of what it handled."""

    def __init__(self, kind: str, url: str, folder: Path, name: str) -> None:
        self.out = folder / f"{name}.txt"
        self.ready = folder / f"{name}.ready"
        self.out.touch()
        # --slow: each handling takes 50 ms, so a consumer always holds work when it dies.
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), kind, url, "chaos", str(self.out), str(self.ready),
             "--slow"]
        )  # fmt: skip

    def handled(self) -> list[int]:
        rows = [line.split() for line in self.out.read_text().splitlines()]
        return [int(row[0]) for row in rows if len(row) == 3]

    async def wait_ready(self) -> None:
        with anyio.fail_after(60):
            while not self.ready.exists():
                assert self.process.poll() is None, "a consumer exited at start"
                await anyio.sleep(0.05)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


class Stream:
    """The steady stream of publishes: what was confirmed and what failed."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.confirmed: list[int] = []
        self.failed: list[int] = []
        self.running = True

    async def run(self) -> None:
        n = 0
        while self.running:
            n += 1
            try:
                await self.bus.publish("work.items", n)
            except TransportError:
                self.failed.append(n)
            else:
                self.confirmed.append(n)
            await anyio.sleep(PACE)  # a pace, not a wait for work

    async def confirms(self, count: int, seconds: float) -> None:
        """Wait until ``count`` more publishes are confirmed (the broker is taking them)."""
        target = len(self.confirmed) + count
        with anyio.fail_after(seconds):
            while len(self.confirmed) < target:
                await anyio.sleep(0.05)


def _runs() -> list[Any]:
    """Each broker, with the time its run may take: a broker whose private server is
    slow to restart (RabbitMQ: about 10 s a time) gets longer."""
    runs = []
    for name in names():
        seconds = 90 if name in names("quick_restart") else 150
        runs.append(pytest.param(name, seconds, marks=pytest.mark.timeout(seconds + 30)))
    return runs


@pytest.mark.parametrize(("kind", "seconds"), _runs())
async def test_chaos_loses_nothing_confirmed(kind: str, seconds: float, tmp_path: Path) -> None:
    started = time.monotonic()
    with anyio.fail_after(seconds):
        # A server that keeps what it confirmed on disk across the kills.
        async with BROKERS[kind].start_private(tmp_path, durable=True) as broker:
            with TcpProxy(broker.port) as proxy:
                stream, consumers = await _chaos(kind, broker, proxy, tmp_path, seconds)
    handled = Counter(n for consumer in consumers for n in consumer.handled())
    confirmed = set(stream.confirmed)
    lost = sorted(confirmed - set(handled))
    duplicated = sum(handled.values()) - len(handled)
    print(
        f"\nchaos {kind}: confirmed={len(confirmed)} delivered={len(confirmed & set(handled))} "
        f"duplicated={duplicated} lost={len(lost)} failed_publishes={len(stream.failed)} "
        f"(of which handled: {len(set(stream.failed) & set(handled))}) "
        f"handlings={sum(handled.values())} in {time.monotonic() - started:.1f} s"
    )
    assert lost == []
    assert confirmed <= set(handled)  # every confirmed publish handled at least once
    assert set(handled) <= confirmed | set(stream.failed)  # nothing from nowhere


async def _chaos(
    kind: str, broker: PrivateServer, proxy: TcpProxy, folder: Path, seconds: float
) -> tuple[Stream, list[Consumer]]:
    """Two consumers, the faults under a steady stream, then wait for every confirmed."""
    proxied = url_for(kind, proxy.port)
    consumers = [
        Consumer(kind, proxied, folder, "through-proxy"),
        Consumer(kind, broker.url, folder, "direct"),
    ]
    try:
        for consumer in consumers:
            await consumer.wait_ready()
        stream = await _run_faults(kind, broker, proxy, proxied, consumers, folder)
        await _wait_delivered(stream.confirmed, consumers, seconds / 3)
    finally:
        for consumer in consumers:
            consumer.stop()
    return stream, consumers


async def _run_faults(
    kind: str,
    broker: PrivateServer,
    proxy: TcpProxy,
    proxied: str,
    consumers: list[Consumer],
    folder: Path,
) -> Stream:
    """Publish through the proxy while each fault happens; return the stream's record."""
    transport = make_transport(kind, proxied, "chaos", publish_timeout=PUBLISH_TIMEOUT)
    async with Bus(transport=transport) as bus, anyio.create_task_group() as tasks:
        stream = Stream(bus)
        tasks.start_soon(stream.run)
        await stream.confirms(100, 30)

        # 1. A consumer process dies mid-stream; a replacement joins the group.
        consumers[1].kill()
        consumers.append(Consumer(kind, broker.url, folder, "replacement"))
        await consumers[-1].wait_ready()
        await stream.confirms(100, 30)

        # 2. Every connection through the proxy is cut (both sides closed).
        proxy.cut()
        await stream.confirms(100, 60)

        # 3. The proxy black-holes for a while: the broker hears nothing, nor do we.
        proxy.blackhole()
        await anyio.sleep(PUBLISH_TIMEOUT + 1)  # the outage lasts this long
        proxy.forward()
        await stream.confirms(100, 60)

        # 4. The broker itself is killed, then started again on its data.
        await broker.kill()
        await anyio.sleep(0.5)  # the outage lasts this long
        await broker.start()
        await stream.confirms(100, 90)
        stream.running = False
    return stream


async def _wait_delivered(confirmed: list[int], consumers: list[Consumer], seconds: float) -> None:
    """Wait (reading the consumers' files) until every confirmed publish was handled,
    or ``seconds`` passed (the counts then tell what is missing)."""
    owed = set(confirmed)
    with anyio.move_on_after(seconds):
        while not owed <= {n for consumer in consumers for n in consumer.handled()}:
            await anyio.sleep(0.1)
