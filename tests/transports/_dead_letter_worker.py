"""A worker process for the shared dead-letter tests: its handler fails until replayed.

    python _dead_letter_worker.py KIND URL PREFIX NAME OUT READY

Subscribes ``jobs.NAME`` in group ``NAME``; a first delivery fails (a dead letter that
this process stores), a replayed one is handled: its id is appended to OUT, flushed
before the handler returns. Creates READY once subscribed; on SIGUSR1 writes to
``READY.count`` how many dead letters its own ``bus.dead_letters`` lists (as it is,
without a refresh: what the dashboard of this process would show); exits cleanly on
SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import anyio
from _brokers import BROKERS  # beside this script

from asyncbus import HEADER_REPLAYED, Bus, Envelope
from asyncbus.transports import Transport


def make_transport(kind: str, url: str, prefix: str) -> Transport:
    """The broker transport called ``kind``."""
    if kind not in BROKERS:
        raise SystemExit(f"unknown transport {kind!r}")
    return BROKERS[kind].make(url, prefix)


async def main(kind: str, url: str, prefix: str, name: str, out: str, ready: str) -> None:
    bus = Bus(transport=make_transport(kind, url, prefix))
    lines = Path(out).open("a", buffering=1)  # noqa: SIM115 - closed at exit

    @bus.subscribe(f"jobs.{name}", group=name, concurrency=4)
    async def handle(envelope: Envelope) -> None:
        if HEADER_REPLAYED not in envelope.headers:
            raise RuntimeError(f"job {envelope.payload} failed in {name}")
        lines.write(f"{envelope.id}\n")
        lines.flush()

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGUSR1) as signals:
        async with bus:
            Path(ready).touch()
            async for received in signals:
                if received == signal.SIGTERM:
                    break
                written = Path(f"{ready}.tmp")
                written.write_text(str(len(bus.dead_letters)))
                written.replace(f"{ready}.count")
    lines.close()


if __name__ == "__main__":
    kind, url, prefix, name, out, ready = sys.argv[1:7]
    anyio.run(main, kind, url, prefix, name, out, ready)
