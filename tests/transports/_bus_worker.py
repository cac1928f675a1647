"""A worker process for the scale-out tests: one Bus over a broker, one competing group.

    python _bus_worker.py KIND URL PREFIX OUT READY [--slow]

Handles every envelope on ``work.items`` in group ``workers`` and appends
``<payload> <attempt> <epoch seconds>`` to OUT (one line per handling, flushed
before the handler returns, so the line exists before the ack). Creates READY once
subscribed; exits cleanly on SIGTERM (the bus drains), and is killed with SIGKILL by
the crash test.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import anyio
from _brokers import BROKERS  # beside this script

from asyncbus import Bus, Envelope
from asyncbus.transports import Transport

ACK_TIMEOUT = 2.0


def make_transport(kind: str, url: str, prefix: str) -> Transport:
    """The broker transport called ``kind``, with a short ack timeout."""
    if kind not in BROKERS:
        raise SystemExit(f"unknown transport {kind!r}")
    return BROKERS[kind].make(url, prefix, ack_timeout=ACK_TIMEOUT)


async def main(kind: str, url: str, prefix: str, out: str, ready: str, slow: bool) -> None:
    bus = Bus(transport=make_transport(kind, url, prefix))
    lines = Path(out).open("a", buffering=1)  # noqa: SIM115 - closed at exit

    @bus.subscribe("work.items", group="workers", concurrency=4, capacity=32)
    async def handle(envelope: Envelope) -> None:
        if slow:
            await anyio.sleep(0.05)
        lines.write(f"{envelope.payload} {envelope.attempt} {time.time()}\n")
        lines.flush()

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with bus:
            Path(ready).touch()
            async for _ in signals:
                break
    lines.close()


if __name__ == "__main__":
    kind, url, prefix, out, ready = sys.argv[1:6]
    anyio.run(main, kind, url, prefix, out, ready, "--slow" in sys.argv[6:])
