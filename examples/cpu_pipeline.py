"""A CPU pipeline: a routing slip carries each line through parse -> checksum -> store.

* ``parse`` is async and cheap: it runs on the event loop.
* ``checksum`` is sync and CPU-bound: ``offload="thread"`` runs it on the bus's worker
  pool (four at a time), so the event loop stays free while it grinds. On a GIL build
  use ``offload="process"`` to use more cores; on free-threaded Python (3.13t/3.14t)
  threads already run in parallel.
* Each stage's return value is the payload of the next hop on the slip, and
  ``bus.request`` waits for the value of the last one.

Run it:

    python examples/cpu_pipeline.py
"""

import hashlib
import itertools
import time

import anyio

import asyncbus
from asyncbus import Bus, Envelope

LINES = 40
ROUNDS = 10_000  # hashing rounds per line: the CPU-bound part

bus = Bus(workers=4)
stored: dict[str, dict] = {}


@bus.subscribe("parse", group="parser")
async def parse(line: str) -> list[int]:
    """Turn ``"3,1,4"`` into ``[3, 1, 4]``; the result goes on to the next hop."""
    return [int(field) for field in line.split(",")]


@bus.subscribe("checksum", group="hasher", offload="thread", concurrency=4)
def checksum(numbers: list[int]) -> dict:
    """Hash the numbers over and over: plain sync code, run on a worker thread."""
    digest = hashlib.sha256(repr(numbers).encode()).digest()
    for _ in range(ROUNDS):
        digest = hashlib.sha256(digest).digest()
    return {"numbers": numbers, "sum": sum(numbers), "digest": digest.hex()[:16]}


@bus.subscribe("store", group="store")
async def store(env: Envelope) -> None:
    """The last hop; annotated ``Envelope`` to see where the payload came from."""
    stored[env.correlation_id] = env.payload


async def heartbeat(ticks: list[float]) -> None:
    """Count event-loop turns while the pipeline runs: the loop is never blocked."""
    while True:
        ticks.append(time.perf_counter())
        await anyio.sleep(0.005)


async def main() -> None:
    async with bus, anyio.create_task_group() as background:
        ticks: list[float] = []
        background.start_soon(heartbeat, ticks)
        started = time.perf_counter()

        for n in range(LINES):
            line = ",".join(str((n * 7 + k) % 10) for k in range(8))
            await bus.publish("parse", line, slip=["checksum", "store"])
        await bus.drain(timeout=60)
        elapsed = time.perf_counter() - started

        # The same route as a request: the caller gets the last stage's return value.
        result = await bus.request("parse", "3,1,4,1,5", slip=["checksum"], timeout=10)
        print(f"request through the slip returned sum={result['sum']} "
              f"digest={result['digest']}")

        for stage in bus.statistics().stages:
            print(f"  {stage.name:<16} acked {stage.acked:>3}  p99 "
                  f"{stage.latency_p99 * 1000:7.2f} ms  concurrency {stage.concurrency}")
        longest_gap = max((b - a for a, b in itertools.pairwise(ticks)), default=0.0)
        print(f"event loop stayed responsive: {len(ticks)} heartbeats, longest gap "
              f"{longest_gap * 1000:.1f} ms")
        background.cancel_scope.cancel()

    assert len(stored) == LINES
    print(f"pipeline done: {LINES} lines parsed, checksummed on the worker pool and "
          f"stored in {elapsed:.2f}s")


if __name__ == "__main__":
    asyncbus.run(main)
