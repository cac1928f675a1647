"""A consumer process for the RabbitMQ transport tests (run as a script, killed by them).

``python _rabbit_worker.py URL PREFIX PATTERN GROUP PREFETCH ACK_TIMEOUT MODE`` subscribes
and prints one JSON line per delivery (``{"id": ..., "attempt": ...}``), flushed:

* ``hold``: never settles, and waits to be killed (``kill -9`` in the tests).
* ``ack``: acks each delivery after printing it, until killed.

A line ``{"ready": true}`` is printed once the subscription is entered.
"""

from __future__ import annotations

import asyncio
import json
import sys

from asyncbus.transports.rabbit import RabbitTransport


async def main(argv: list[str]) -> None:
    """Subscribe as told by ``argv`` and report each delivery on stdout."""
    url, prefix, pattern, group, prefetch, ack_timeout, mode = argv
    async with (
        RabbitTransport(url, prefix=prefix, ack_timeout=float(ack_timeout)) as transport,
        transport.subscribe(pattern, group=group, prefetch=int(prefetch)) as deliveries,
    ):
        # The group's queue exists once the subscription is entered: what is published
        # from now on waits for this consumer (or another one).
        print(json.dumps({"ready": True}), flush=True)
        async for delivery in deliveries:
            if mode == "ack":
                await delivery.ack()
            envelope = delivery.envelope
            print(json.dumps({"id": envelope.id, "attempt": envelope.attempt}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
