"""A requester process that dies without closing: its reply inbox must not outlive it.

    python _requester_worker.py KIND URL PREFIX INBOX_TTL

Runs one Bus over the broker ``KIND`` whose transport keeps its inbox for
``INBOX_TTL`` seconds once this process stops renewing it, asks ``ask`` for 1, prints
``{"answer": ...}`` and waits to be killed.
"""

from __future__ import annotations

import json
import sys

import anyio
from _brokers import BROKERS  # beside this script

from asyncbus import Bus
from asyncbus.transports import Transport


def make_transport(kind: str, url: str, prefix: str, inbox_ttl: float) -> Transport:
    """The broker transport called ``kind``, with a short inbox lifetime."""
    if kind not in BROKERS:
        raise SystemExit(f"unknown transport {kind!r}")
    transport = BROKERS[kind].make(url, prefix)
    transport.inbox_ttl = inbox_ttl  # type: ignore[attr-defined]
    return transport


async def main(kind: str, url: str, prefix: str, inbox_ttl: float) -> None:
    async with Bus(transport=make_transport(kind, url, prefix, inbox_ttl)) as bus:
        answer = await bus.request("ask", 1, timeout=20)
        sys.stdout.write(json.dumps({"answer": answer}) + "\n")
        sys.stdout.flush()
        await anyio.sleep_forever()


if __name__ == "__main__":
    kind, url, prefix, inbox_ttl = sys.argv[1:5]
    anyio.run(main, kind, url, prefix, float(inbox_ttl))
