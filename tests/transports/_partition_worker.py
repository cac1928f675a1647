"""A replica for the partition tests: one Bus over a broker, an ordered group split into
partitions.

    python _partition_worker.py KIND URL PREFIX OUT READY

Handles ``orders`` in group ``g`` (``ordering="key"``, ``partitions=4``) and appends
``start <key> <n> <epoch seconds>`` before each handling and ``end <key> <n> <epoch
seconds>`` after it to OUT (its own file, flushed at once, so a line exists before the
ack). Creates READY once it serves its first partition; exits cleanly on SIGTERM (the
bus drains and hands its partitions over), and is killed with SIGKILL by the take-over
test.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import anyio
from _brokers import BROKERS  # beside this script

from asyncbus import Bus, Envelope, _partitions

#: Longer than the partitions' lease (shortened here, so the test is quick): the
#: broker gives a killed replica's unsettled envelopes out again only after the next
#: owner took its partitions, which must wait for them.
ACK_TIMEOUT = 4.0
PARTITIONS = 4
_partitions.LEASE = 2.0
_partitions.RENEW_EVERY = 0.5
_partitions.STOP_AFTER = 1.2


async def main(kind: str, url: str, prefix: str, out: str, ready: str) -> None:
    transport = BROKERS[kind].make(url, prefix, ack_timeout=ACK_TIMEOUT)
    bus = Bus(transport=transport)
    lines = Path(out).open("a", buffering=1)  # noqa: SIM115 - closed at exit

    @bus.subscribe("orders", group="g", concurrency=8, ordering="key", partitions=PARTITIONS)
    async def handle(envelope: Envelope) -> None:
        key, n = envelope.payload
        lines.write(f"start {key} {n} {time.time()}\n")
        await anyio.sleep(0.02)
        lines.write(f"end {key} {n} {time.time()}\n")

    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async with bus:
            while not bus.statistics().stage("orders@g").partitions_owned:
                await anyio.sleep(0.05)
            Path(ready).touch()
            async for _ in signals:
                break
    lines.close()


if __name__ == "__main__":
    anyio.run(main, *sys.argv[1:6])
