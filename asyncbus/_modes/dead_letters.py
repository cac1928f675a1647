"""Over a broker whose store every process shares, the dead-letter queue is its view.

:func:`watch` keeps a :class:`~asyncbus._dead_letters.DeadLetterQueue` up to date from
what :meth:`~asyncbus.transports.SharedDeadLetters.watch_dead_letters` reports (the
first read is the bus's start), and :class:`BrokerStore` is the store as the queue's
replay and refresh use it: read, take (the claim), put back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from .._dead_letters import DeadLetter, DeadLetterQueue
from .._failures import describe_error
from ..transports._bound import BoundTransport
from ..transports._kit import Backoff
from ..transports.base import SharedDeadLetters

__all__ = ["BrokerStore", "watch"]

dead_letter_logger = logging.getLogger("asyncbus.dead_letters")

#: Pauses before watching the broker's dead letters again after a failure (seconds).
_WATCH_BACKOFF_MIN = 0.1
_WATCH_BACKOFF_MAX = 2.0


async def watch(
    shared: SharedDeadLetters,
    queue: DeadLetterQueue,
    *,
    task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``queue`` the view of the broker's dead letters, until cancelled.

    The caller read the store once already (that read's failure is the start's,
    raised where the bus starts rather than out of a task group); a failure here is
    logged and the watch begins again (after a pause doubling up to 2 s), with a fresh
    read. Started once the watch is entered and read, or once it first failed.
    """
    started = False
    failing = False  # (a broker that stays down is logged once, not every pause)
    backoff = Backoff(_WATCH_BACKOFF_MIN, _WATCH_BACKOFF_MAX)
    while True:
        try:
            async with shared.watch_dead_letters() as changes:
                # Entered first, read next: nothing changed between goes unseen.
                await queue.refresh()
                if not started:
                    started = True
                    task_status.started()
                elif failing:
                    dead_letter_logger.info("the broker's dead letters: watching again")
                failing = False
                backoff.reset()
                async for change in changes:
                    if change.stale:
                        await queue.refresh()
                    else:
                        queue.changed(change.added, change.removed)
        except Exception as error:  # deliberate: the watch goes on while the bus runs
            if not started:
                started = True
                task_status.started()
            dead_letter_logger.log(
                logging.DEBUG if failing else logging.WARNING,
                "the broker's dead letters: watching them failed (the list may fall "
                "behind until it works again): %s",
                describe_error(error),
            )
            failing = True
        await backoff.sleep()


class BrokerStore:
    """A broker's store every process shares, as the dead-letter queue uses it."""

    def __init__(self, shared: SharedDeadLetters, port: BoundTransport) -> None:
        self._shared = shared
        self._port = port

    async def load(self) -> list[DeadLetter]:
        """Every entry the broker keeps, oldest first."""
        return await self._port.dead_letters()

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Take the entries of ``ids`` out of the broker (the claim); those this got."""
        with self._port.transport.cleanup_scope():
            return await self._shared.take_dead_letters(ids)

    async def put_back(self, entries: Sequence[DeadLetter]) -> None:
        """Store ``entries`` again (logged, not raised, when the broker refuses)."""
        try:
            with self._port.transport.cleanup_scope():
                await self._shared.restore_dead_letters(entries)
        except Exception:
            dead_letter_logger.error(
                "dead letters %s were taken for a replay that failed, and could not be "
                "stored again",
                ", ".join(entry.envelope.id for entry in entries),
                exc_info=True,
            )
