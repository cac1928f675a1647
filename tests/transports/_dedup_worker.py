"""A worker process for the deduplication tests: one Bus with ``deduplicate()`` over a broker.

    python _dedup_worker.py KIND URL PREFIX OUT READY MODE LEASE

Handles ``work.items`` in group ``workers`` and appends ``<event> <envelope id>`` to
OUT (flushed at once). Creates READY once subscribed. MODE:

* ``die-after-done``: handles, the store marks it done, then the process SIGKILLs
  itself before the bus acks (a crash between the work and the ack);
* ``hang``: writes ``started``, then never returns (the test SIGKILLs it mid-work).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, middleware
from asyncbus.middleware import deduplicate

ACK_TIMEOUT = 1.5


async def main(kind: str, url: str, prefix: str, out: str, ready: str, mode: str, lease: str):
    lines = Path(out).open("a", buffering=1)  # noqa: SIM115 - the process ends by SIGKILL

    @middleware
    async def die_after_done(envelope: Envelope, call_next: Any) -> Any:
        result = await call_next(envelope)  # deduplicate() marked it done by now
        lines.write(f"done {envelope.id}\n")
        lines.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # before the bus acks it
        return result

    chain = [deduplicate(lease=float(lease))]
    if mode == "die-after-done":
        chain.insert(0, die_after_done)
    bus = Bus(
        transport=make_transport(kind, url, prefix, ack_timeout=ACK_TIMEOUT), middleware=chain
    )

    @bus.subscribe("work.items", group="workers")
    async def handle(envelope: Envelope) -> None:
        lines.write(f"started {envelope.id}\n")
        lines.flush()
        if mode == "hang":
            await anyio.sleep_forever()

    async with bus:
        Path(ready).touch()
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:8])
