"""A group's handlers in flight across every replica: ``subscribe(..., max_in_flight=N)``.

``concurrency`` bounds one process's consumers; ``max_in_flight`` bounds how many
handlers of the stage run at once in all the processes of its group together, for a
downstream that takes only so many calls at a time. A handler starts only once it
holds one of the ``N`` slots, and gives it back when its chain returns (ack, retry,
dead letter: a retry waiting for its timer holds no slot).

In one process the slots are this process's (an envelope waits in its consumer until
one is free, first come first served). Over a broker that keeps leases (a
:class:`~asyncbus._leases.LeaseStore`: Redis, NATS, PostgreSQL), each slot is also a
lease in the broker, taken before the handler starts, renewed while it runs and given
back after; a process that dies holding one loses it when the lease runs out
(:data:`LEASE` seconds), so its slots come back to the group. A broker that does not
answer leaves each process its own ``N`` meanwhile (logged); a broker without leases
(RabbitMQ) limits per process.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from collections import deque
from typing import Any

import anyio

from ._exceptions import TransportError
from ._handling import current_handling
from ._leases import LeaseStore
from ._types import Handler

__all__ = ["LEASE", "FlightLimit"]

logger = logging.getLogger("asyncbus.flights")

#: Seconds a lease lasts unless renewed: how long a dead process's slots stay taken.
LEASE = 15.0
#: Seconds between two renewals of the leases a process holds.
RENEW_EVERY = LEASE / 3
#: Seconds between two asks for a slot while the group's slots are all taken: the
#: first, and the most (the pause doubles in between, with jitter).
FIRST_ASK, LONGEST_ASK = 0.01, 0.25


class FlightLimit:
    """The slots of one stage: at most ``limit`` of its handlers at once, everywhere.

    :param stage: the stage's name (its slots' name in the broker).
    :param limit: the most handlers of the stage running at once in the group.
    """

    def __init__(self, stage: str, limit: int) -> None:
        self.stage = stage
        self.limit = limit
        #: This process's free slots (at most ``limit`` here, whatever the broker says)
        #: and the handlers waiting for one, first first: made of events of the loop
        #: that waits, so a bus may run on one event loop, then on another.
        self._free = limit
        self._line: deque[anyio.Event] = deque()
        #: The broker's leases, found at the first envelope (``None``: none kept).
        self._store: LeaseStore | None = None
        self._chosen = False
        #: Lease holders of this process running now (renewed by the keeper).
        self._held: set[str] = set()
        self._prefix = f"{os.getpid()}-{uuid.uuid4().hex[:12]}-"
        self._serial = 0
        self._keeping = False
        #: Whether the broker's leases could not be taken last time (warned once).
        self._unshared = False
        #: Handlers running now (holding a slot) and waiting for one, in this process.
        self.running = 0
        self.waiting = 0

    def __call__(self, chain: Handler) -> Handler:
        """``chain`` run only while it holds a slot."""

        async def handle(envelope: Any) -> Any:
            if self._free and not self._line:
                self._free -= 1
            else:
                await self._wait_local()
            try:
                holder = await self._lease()
                self.running += 1
                try:
                    return await chain(envelope)
                finally:
                    self.running -= 1
                    if holder is not None:
                        await self._give_back(holder)
            finally:
                self._give_local()

        return handle

    async def _wait_local(self) -> None:
        """Wait in line for one of this process's slots (handed over by its holder)."""
        handed = anyio.Event()
        self._line.append(handed)
        self.waiting += 1
        try:
            await handed.wait()
        except BaseException:  # deliberate: however the wait ends, no slot is lost
            if handed in self._line:
                self._line.remove(handed)
            else:
                self._give_local()  # it was handed a slot as it was cancelled: pass it on
            raise
        finally:
            self.waiting -= 1

    def _give_local(self) -> None:
        """A slot of this process is free: to the first in line, or kept."""
        if self._line:
            self._line.popleft().set()
        else:
            self._free += 1

    async def _lease(self) -> str | None:
        """Take a lease in the broker, when it keeps them: its holder, else ``None``."""
        if not self._chosen:
            self._chosen = True
            handling = current_handling()
            self._store = handling.host.lease_store() if handling is not None else None
        store = self._store
        if store is None:
            return None
        self._serial += 1
        holder = f"{self._prefix}{self._serial}"
        pause = FIRST_ASK
        self.waiting += 1
        try:
            while True:
                try:
                    taken = await store.acquire(self.stage, self.limit, holder, LEASE)
                except TransportError as error:
                    self._lost(error)
                    return None
                self._found()
                if taken:
                    break
                await anyio.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, LONGEST_ASK)
        finally:
            self.waiting -= 1
        self._held.add(holder)
        if not self._keeping:
            self._keeping = True
            handling = current_handling()
            assert handling is not None  # (a store was found through it)
            handling.host.start_soon(self._keep, store, name=f"asyncbus leases {self.stage}")
        return holder

    async def _give_back(self, holder: str) -> None:
        self._held.discard(holder)
        store = self._store
        assert store is not None
        try:
            with anyio.CancelScope(shield=True):
                with anyio.move_on_after(LEASE / 3):
                    await store.release(self.stage, holder)
        except TransportError as error:
            # It runs out by itself, LEASE seconds after its last renewal.
            logger.warning("max_in_flight of %s: a slot was not given back: %s", self.stage, error)

    async def _keep(self, store: LeaseStore) -> None:
        """Renew this process's leases until the bus stops (a bus started again finds
        its store anew)."""
        try:
            await self._renew_forever(store)
        finally:
            self._keeping = self._chosen = False

    async def _renew_forever(self, store: LeaseStore) -> None:
        while True:
            await anyio.sleep(RENEW_EVERY)
            held = sorted(self._held)
            if not held:
                continue
            try:
                kept = await store.renew(self.stage, held, LEASE)
            except TransportError as error:
                self._lost(error)
                continue
            if kept < len(held):
                logger.warning(
                    "max_in_flight of %s: %d of this process's %d slot(s) ran out before "
                    "they were renewed (a stall longer than %g s): the group may run more "
                    "than %d handlers at once until they end",
                    self.stage,
                    len(held) - kept,
                    len(held),
                    LEASE,
                    self.limit,
                )

    def _lost(self, error: TransportError) -> None:
        if not self._unshared:
            logger.warning(
                "max_in_flight of %s: the broker's slots cannot be taken, this process "
                "limits on its own (%d at once) meanwhile: %s",
                self.stage,
                self.limit,
                error,
            )
        self._unshared = True

    def _found(self) -> None:
        if self._unshared:
            logger.warning("max_in_flight of %s: the broker's slots are taken again", self.stage)
        self._unshared = False
