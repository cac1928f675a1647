"""Publishers running through a broker's fault: what each publish did, and what a bus
handled, for the cluster failover tests (``test_nats_cluster``, ``test_redis_cluster``).

``LoadThroughAFault(bus)`` subscribes a counting handler to ``jobs`` (group
``workers``); ``await load.run(fault)`` starts ``writers`` publishers over ``total``
numbered envelopes, calls ``fault()`` once a third of them is confirmed, and returns
when every publisher is done; ``await load.handled_again(after)`` publishes a marker
until one is confirmed and waits for it to be handled, returning the seconds since
``after``; ``await load.after_return()`` publishes more once the killed node is back
and tells how many times each was handled.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from asyncbus import Bus, TransportError

__all__ = ["LoadThroughAFault"]

#: The marker published once the fault is over (never one of the numbered envelopes).
MARKER = -1


class LoadThroughAFault:
    """Numbered publishes through a fault, and their handling, on one bus."""

    def __init__(self, bus: Bus, *, total: int = 3000, writers: int = 100) -> None:
        self.bus = bus
        self.total = total
        self.writers = writers
        #: Confirmed publishes: number -> when the confirmation came.
        self.confirmed: dict[int, float] = {}
        #: Publishes that raised ``TransportError``.
        self.failed: set[int] = set()
        #: How long each publish took, confirmed or failed.
        self.took: list[float] = []
        #: What the handler got, in order, copies included.
        self.handled: list[int] = []
        #: When each number was first handled.
        self.handled_at: dict[int, float] = {}
        #: When ``fault()`` was called.
        self.fault_at = 0.0
        self._a_third = anyio.Event()
        self._marker = anyio.Event()

        @bus.subscribe("jobs", group="workers", concurrency=8)
        async def work(n: int) -> None:
            self.handled.append(n)
            self.handled_at.setdefault(n, anyio.current_time())
            if n == MARKER:
                self._marker.set()

    async def _publisher(self, first: int) -> None:
        for n in range(first, self.total, self.writers):
            began = anyio.current_time()
            try:
                await self.bus.publish("jobs", n)
            except TransportError:
                self.failed.add(n)
            else:
                self.confirmed[n] = anyio.current_time()
                if len(self.confirmed) == self.total // 3:
                    self._a_third.set()
            self.took.append(anyio.current_time() - began)

    async def run(self, fault: Callable[[], Awaitable[None]]) -> None:
        """Publish everything, calling ``fault()`` once a third is confirmed."""
        async with anyio.create_task_group() as publishing:
            for first in range(self.writers):
                publishing.start_soon(self._publisher, first)
            await self._a_third.wait()
            self.fault_at = anyio.current_time()
            await fault()

    async def handled_again(self, after: float) -> float:
        """Publish the marker until it is confirmed; seconds from ``after`` until the
        bus handled it (once every publisher is done)."""
        while True:
            try:
                await self.bus.publish("jobs", MARKER)
                break
            except TransportError:
                await anyio.sleep(0.2)
        await self._marker.wait()
        return anyio.current_time() - after

    async def after_return(self, count: int = 100) -> list[int]:
        """Publish ``count`` more numbered envelopes (after the ``total`` first) one by
        one, each once, and drain: how many times each was handled."""
        numbers = range(self.total, self.total + count)
        for n in numbers:
            await self.bus.publish("jobs", n)
        await self.bus.drain(30)
        return [self.handled.count(n) for n in numbers]

    def resumed_in(self) -> float:
        """Seconds from the fault until the first envelope confirmed after it was handled:
        when deliveries resumed."""
        later = [n for n, at in self.confirmed.items() if at > self.fault_at]
        return min(self.handled_at[n] for n in later) - self.fault_at

    @property
    def delivered(self) -> set[int]:
        """The first ``total`` numbered envelopes handled (at least once)."""
        return {n for n in self.handled if 0 <= n < self.total}

    def summary(self, what: str, marker_in: float) -> str:
        """One line of counts for the test's output."""
        delivered = self.delivered
        twice = sum(1 for n in self.handled if 0 <= n < self.total) - len(delivered)
        return (
            f"\n{what}: {len(self.confirmed)} confirmed, {len(self.failed)} failed "
            f"(TransportError; {len(self.failed & delivered)} of them stored all the same), "
            f"{len(set(self.confirmed) - delivered)} confirmed but lost, {twice} handled "
            f"twice, slowest publish {max(self.took):.2f} s, deliveries resumed "
            f"{self.resumed_in():.2f} s after the fault, the marker handled {marker_in:.2f} s "
            f"after it was first tried"
        )
