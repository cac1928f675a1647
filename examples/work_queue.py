"""A work queue: three workers in one group compete for jobs, so each job runs once.

Handlers subscribed with the *same* group share one stage: every job goes to exactly
one of them (over a broker, processes that use the group share the work the same
way). A subscriber in a *different* group gets every job as well (fan-out), here an
audit log.

Run it:

    python examples/work_queue.py
"""

import random
from collections import Counter
from collections.abc import Awaitable, Callable

import anyio

import asyncbus
from asyncbus import Bus

JOBS = 30

bus = Bus()
handled_by: Counter[str] = Counter()
handled_jobs: list[int] = []
audited: list[int] = []


def make_worker(name: str) -> Callable[[dict], Awaitable[None]]:
    """One worker of the "resizers" group; ``name`` tells the workers apart."""

    async def resize(job: dict) -> None:
        await anyio.sleep(random.uniform(0.001, 0.02))  # the I/O-bound part of the job
        handled_by[name] += 1
        handled_jobs.append(job["n"])

    return resize


for worker_name in ("worker-1", "worker-2", "worker-3"):
    # Same topic, same group: the three compete. Each has its own consumer task.
    bus.subscribe("images.uploaded", make_worker(worker_name), group="resizers")


@bus.subscribe("images.uploaded", group="audit")
async def audit(job: dict) -> None:
    """Another group: it gets every job too, whoever resized it."""
    audited.append(job["n"])


async def main() -> None:
    async with bus:
        for n in range(JOBS):
            await bus.publish("images.uploaded", {"n": n, "path": f"/uploads/{n}.png"})
        await bus.drain(timeout=30)

        stage = bus.statistics().stage("images.uploaded@resizers")
        print(f"stage {stage.name}: concurrency {stage.concurrency}, published "
              f"{stage.published}, acked {stage.acked}, dead-lettered {stage.dead_lettered}")
        for name, count in sorted(handled_by.items()):
            print(f"  {name} handled {count} jobs")

    assert sorted(handled_jobs) == list(range(JOBS)), "a job was lost or handled twice"
    assert sorted(audited) == list(range(JOBS))
    print(f"{JOBS} jobs, each handled exactly once by one of {len(handled_by)} workers; "
          f"audit saw all {len(audited)}")


if __name__ == "__main__":
    asyncbus.run(main)
