"""A worker process for the deployment-view tests.

    python _cluster_worker.py KIND URL PREFIX NAME N READY

Subscribes ``jobs.NAME`` in group ``NAME``, publishes N envelopes there and handles
them, with heartbeats every 0.2 s; creates READY once all N are acked, then runs until
SIGTERM (its bus closes, deleting its heartbeat).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
from _dead_letter_worker import make_transport

from asyncbus import Bus


async def main(kind: str, url: str, prefix: str, name: str, count: int, ready: str) -> None:
    bus = Bus(transport=make_transport(kind, url, prefix), name=name, heartbeat=0.2)

    @bus.subscribe(f"jobs.{name}", group=name)
    async def handle(n: int) -> None:
        pass

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with bus:
            await bus.subscribed()
            for n in range(count):
                await bus.publish(f"jobs.{name}", n)
            await bus.drain()
            Path(ready).touch()
            async for _ in signals:
                break


if __name__ == "__main__":
    kind, url, prefix, name, count, ready = sys.argv[1:7]
    anyio.run(main, kind, url, prefix, name, int(count), ready)
