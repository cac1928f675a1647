"""When the bus is idle: ``drain()``, the waiters it parks until then, and what a
timed-out one was still waiting for."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

import anyio

from ._checks import check_wait
from ._handling import HandlingHost, current_handling

if TYPE_CHECKING:
    from ._life import Life
    from ._modes import Mode
    from ._publishing import Publisher
    from ._stage import Stage

__all__ = ["DrainWaiter", "Draining", "Waiting"]

#: Seconds before the first look again at a broker backlog that is not empty yet, and
#: the most between two looks (each doubles the last).
_FIRST_LOOK = 0.002
_LAST_LOOK = 0.02


class DrainWaiter:
    """One ``drain()`` waiting; ``strict`` unless it runs in a handler of the bus."""

    __slots__ = ("event", "strict")

    def __init__(self, strict: bool) -> None:
        self.event = anyio.Event()
        self.strict = strict


class Waiting(HandlingHost, Protocol):
    """The bus's services, as ``drain()`` reads them: where its waiters and the background
    tasks are kept, and the host of its handlings."""

    #: ``drain()`` calls waiting for the bus to be idle.
    idle_waiters: list[DrainWaiter]
    #: Background tasks running (dead letters stored, announced), which ``drain()`` waits for.
    background: int


class Draining:
    """Tells when one bus is idle and releases the ``drain()`` calls waiting for it."""

    __slots__ = ("_life", "_mode", "_services", "_stages", "publisher")

    #: Whose thread-safe publishes not yet settled ``drain()`` waits for; set once the
    #: publisher is made (it is handed :meth:`wake`).
    publisher: Publisher

    def __init__(
        self, services: Waiting, stages: dict[tuple[str, str], Stage], mode: Mode, life: Life
    ) -> None:
        self._services = services
        self._stages = stages
        self._mode = mode
        self._life = life

    async def drain(self, timeout: float | None) -> None:
        """``Bus.drain``: wait until every queue is empty and nothing is in flight.

        :raises TimeoutError: not within ``timeout`` seconds, saying what is left.
        :raises ConfigurationError: for a timeout that is not ``None`` or a finite
            number ``>= 0``.
        """
        seconds = check_wait(timeout, "drain(timeout)")
        handling = current_handling()
        stage = None
        # In a handler: what it holds (one envelope, or a batch's) is not waited for.
        in_hand = handling.in_hand() if handling is not None else 0
        if in_hand and handling is not None and handling.host is self._services:
            stage = handling.stage
            stage.draining += in_hand
            self.wake()  # another handler's drain may have waited for this one
        try:
            with anyio.move_on_after(seconds):
                await self.wait_idle(strict=stage is None)
                return
        finally:
            if stage is not None:
                stage.draining -= in_hand
        raise TimeoutError(self._not_drained(timeout))

    async def wait_idle(self, *, strict: bool) -> None:
        """Wait until the bus is idle (``strict``: handlers that drain included), its
        broker backlog too, or closed."""
        services = self._services
        pause = _FIRST_LOOK
        while True:
            while not self.idle(strict):
                if self._life.state == "closed":
                    return
                waiter = DrainWaiter(strict)
                services.idle_waiters.append(waiter)
                try:
                    await waiter.event.wait()
                finally:
                    # Timed out or cancelled: leave nothing behind (a woken waiter was
                    # already taken off the list).
                    if not waiter.event.is_set():
                        with contextlib.suppress(ValueError):
                            services.idle_waiters.remove(waiter)
            if not await self._mode.backlog(self._stages.values()):
                return
            # Envelopes still in the broker for our stages: look again shortly, soon at
            # first (most often they are acks written behind, a few milliseconds away).
            await anyio.sleep(pause)
            pause = min(pause * 2, _LAST_LOOK)

    def idle(self, strict: bool = True) -> bool:
        """Whether nothing is queued, in flight, waiting for a retry or on its way
        (not ``strict``: the handlers awaiting ``drain()`` left out)."""
        if self._services.background or self.publisher.threadsafe_pending:
            return False
        if strict:
            return all(stage.idle for stage in self._stages.values())
        return all(stage.quiet for stage in self._stages.values())

    def wake(self) -> None:
        """Release every ``drain()`` whose wait is over now."""
        services = self._services
        if not services.idle_waiters or not self.idle(strict=False):
            return
        everything = self.idle(strict=True)
        waiting = []
        for waiter in services.idle_waiters:
            if everything or not waiter.strict:
                waiter.event.set()
            else:
                waiting.append(waiter)
        services.idle_waiters = waiting

    def release(self) -> None:
        """The bus closed: release every ``drain()`` still waiting."""
        for waiter in self._services.idle_waiters:
            waiter.event.set()
        self._services.idle_waiters.clear()

    def _not_drained(self, timeout: float | None) -> str:
        """What a ``drain(timeout)`` that ran out of time was still waiting for."""
        busy = [stage for stage in self._stages.values() if not stage.idle]
        waiting: list[str] = []
        if busy:
            queued = sum(stage.queued for stage in busy)
            in_flight = sum(stage.in_flight for stage in busy)
            named = ", ".join(f"{s.name} {s.queued} + {s.in_flight}" for s in busy[:5])
            if len(busy) > 5:
                named += f" and {len(busy) - 5} more stage(s)"
            waiting.append(
                f"{queued} envelope(s) queued + {in_flight} in flight or waiting for a retry "
                f"({named})"
            )
            if entering := sum(stage.entering for stage in busy):
                waiting.append(f"{entering} publish(es) waiting for room")
        pending = self.publisher.threadsafe_pending
        if pending:
            waiting.append(f"{pending} thread-safe publish(es) not yet routed")
        background = self._services.background
        if background:
            waiting.append(f"{background} dead-letter or announcement task(s)")
        if not waiting:
            waiting.append("envelopes still in the broker for this bus's stages")
        return f"not drained within {timeout}s: still {'; '.join(waiting)}"
