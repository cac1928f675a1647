"""The order service scaled out over Redis: two worker processes share one group.

Needs Redis on 127.0.0.1:6379 and ``pip install -e '.[redis]'``. Run::

    python examples/scaled_out_redis.py

The script starts two copies of itself as workers (``--worker NAME``). Each runs the
same ``Bus`` code as an in-process service, only with ``transport=RedisTransport(...)``:
both subscribe in group ``fulfilment``, so each order goes to exactly one of them.
Workers report every fulfilled order on ``orders.fulfilled``; the main process counts
them, then tells the workers to stop on ``control.stop`` (each worker in its own
group, so both get it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import anyio

import asyncbus
from asyncbus import Bus
from asyncbus.transports import RedisTransport

URL = "redis://127.0.0.1:6379/0"
ORDERS = 200


def transport(prefix: str) -> RedisTransport:
    return RedisTransport(URL, prefix=prefix)


def worker_bus(name: str, prefix: str, stop: Callable[[], object]) -> Bus:
    """The bus of the worker ``name``; it calls ``stop()`` when told to stop."""
    bus = Bus(transport=transport(prefix), name=name)

    @bus.subscribe("orders.created", group="fulfilment", concurrency=4)
    async def fulfil(order: dict[str, Any]) -> None:
        """Pack the order's parcel, then report it on orders.fulfilled."""
        await anyio.sleep(0.001)  # pack the parcel
        await bus.publish("orders.fulfilled", {"order": order["id"], "by": name})

    @bus.subscribe("control.stop", group=f"control-{name}")
    async def stop_now(_: Any) -> None:
        """Stop this worker (each worker has a group of its own: all of them stop)."""
        stop()

    return bus


async def worker(name: str, prefix: str) -> None:
    stop = anyio.Event()
    async with worker_bus(name, prefix, stop.set):
        print(f"{name} ready", flush=True)
        await stop.wait()


async def main() -> None:
    prefix = f"asyncbus-example-{os.getpid()}"
    bus = Bus(transport=transport(prefix))
    fulfilled: Counter[int] = Counter()
    by_worker: Counter[str] = Counter()
    done = anyio.Event()

    @bus.subscribe("orders.fulfilled", group="tracker")
    async def track(report: dict[str, Any]) -> None:
        fulfilled[report["order"]] += 1
        by_worker[report["by"]] += 1
        if len(fulfilled) == ORDERS:
            done.set()

    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker", name, prefix],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("worker-1", "worker-2")
    ]
    try:
        async with bus:
            for process in workers:  # wait until both groups are subscribed
                assert process.stdout is not None
                await anyio.to_thread.run_sync(process.stdout.readline)
            for number in range(ORDERS):
                await bus.publish("orders.created", {"id": number})
            with anyio.fail_after(60):
                await done.wait()
            await bus.publish("control.stop")
            await bus.drain()
    finally:
        for process in workers:
            process.wait(timeout=30)
        await forget(prefix)
    shares = ", ".join(f"{name}: {count}" for name, count in sorted(by_worker.items()))
    print(f"{ORDERS} orders fulfilled by two processes ({shares})")
    print(f"each exactly once: {sorted(fulfilled.values()) == [1] * ORDERS}")


async def forget(prefix: str) -> None:
    """Delete the example's keys from Redis."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        asyncbus.run(worker, sys.argv[2], sys.argv[3])
    else:
        asyncbus.run(main)
