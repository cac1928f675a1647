"""Handlers that meet: proof that some run at once, by counting rather than timing."""

from __future__ import annotations

import anyio


class Meeting:
    """Handlers call :meth:`attend`: each waits until ``size`` of them are inside at once
    (then all go on); ``now`` and ``most`` count who is inside, ``arrived`` every call.

    :param hold: an event the handlers also wait for before they leave (set by the test).
    """

    def __init__(self, size: int, hold: anyio.Event | None = None) -> None:
        self.size = size
        self.full = anyio.Event()
        self.hold = hold
        self.now = self.most = self.arrived = 0

    async def attend(self) -> None:
        self.now += 1
        self.arrived += 1
        self.most = max(self.most, self.now)
        if self.now == self.size:
            self.full.set()
        try:
            await self.full.wait()
            if self.hold is not None:
                await self.hold.wait()
            for _ in range(3):
                await anyio.sleep(0)
        finally:
            self.now -= 1
