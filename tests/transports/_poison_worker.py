"""A worker process whose handler kills it: the poison that crashes its consumer.

    python _poison_worker.py KIND URL PREFIX MAX_DELIVERIES [UNLUCKY [CAPACITY]]

Runs one Bus over the broker ``KIND`` with ``max_deliveries=MAX_DELIVERIES`` and a
short ack timeout. Prints JSON lines: ``{"ready": true}`` once subscribed,
``{"handling": attempt}`` just before its handler ends the process (``os._exit``, as
a segfault or an OOM kill would), and ``{"dead": reason, "error": ...}`` for each
envelope the bus dead-letters. With ``UNLUCKY`` (an int), only that payload kills
the process (``{"handling": attempt, "payload": UNLUCKY}``); any other is handled,
``{"handled": payload, "attempt": attempt}``, by a stage of ``CAPACITY`` (8 unless
given). Killed by the test when no longer needed.
"""

from __future__ import annotations

import json
import os
import sys

import anyio
from _brokers import BROKERS  # beside this script

from asyncbus import Bus, DeadLetter, Envelope
from asyncbus.transports import Transport

ACK_TIMEOUT = 1.0


def _say(line: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def make_transport(kind: str, url: str, prefix: str, max_deliveries: int) -> Transport:
    """The broker transport called ``kind``."""
    if kind not in BROKERS:
        raise SystemExit(f"unknown transport {kind!r}")
    return BROKERS[kind].make(url, prefix, ack_timeout=ACK_TIMEOUT, max_deliveries=max_deliveries)


async def main(
    kind: str, url: str, prefix: str, max_deliveries: int, unlucky: int | None, capacity: int
) -> None:
    bus = Bus(transport=make_transport(kind, url, prefix, max_deliveries))

    @bus.subscribe("poison.*", group="g", capacity=capacity)
    async def crash(envelope: Envelope) -> None:
        if unlucky is not None and envelope.payload != unlucky:
            _say({"handled": envelope.payload, "attempt": envelope.attempt})
            return
        if unlucky is None:
            _say({"handling": envelope.attempt})
        else:
            _say({"handling": envelope.attempt, "payload": unlucky})
        os._exit(3)

    @bus.subscribe("$deadletter")
    async def tell(entry: DeadLetter) -> None:
        _say({"dead": entry.reason.value, "error": entry.error})

    async with bus:
        _say({"ready": True})
        await anyio.sleep_forever()


if __name__ == "__main__":
    kind, url, prefix, max_deliveries = sys.argv[1:5]
    unlucky = int(sys.argv[5]) if len(sys.argv) > 5 else None
    capacity = int(sys.argv[6]) if len(sys.argv) > 6 else 8
    anyio.run(main, kind, url, prefix, int(max_deliveries), unlucky, capacity)
