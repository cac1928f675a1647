"""Dead letters: record, announce on ``$deadletter``, store, replay.

A dead letter is logged (rate-limited), kept in the bus's bounded
:class:`DeadLetterQueue`, stored where the mode keeps them (a broker), announced on
``$deadletter`` to this process's subscribers (never begetting another), and fails a
request waiting for the envelope. Replaying an entry re-sends it, ``attempt`` 1 and the
``asyncbus-replayed`` header, to the stage that dead-lettered it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from . import _instrument
from ._carry import with_headers
from ._dead_letters import DEADLETTER_TOPIC, DeadLetter, DeadLetterQueue, DeadLetterReason
from ._door import DoorOutcome
from ._envelope import HEADER_REPLAYED, Envelope, Receipt, make_receipt
from ._exceptions import BusClosedError, not_started
from ._failures import short_traceback
from ._handling import current_handling
from ._modes import Mode, ModeHost
from ._replies import Replies
from ._routing import Router
from ._stage import Stage

__all__ = ["DeadLettering"]

logger = logging.getLogger("asyncbus.bus")


class DeadLettering:
    """Where a bus's dead letters are recorded, announced and replayed from."""

    def __init__(
        self,
        name: str,
        mode: Mode,
        host: ModeHost,
        router: Router[Stage],
        replies: Replies,
        state: Callable[[], str],
        ttl: float,
        maxlen: int,
        clock: Callable[[], float],
    ) -> None:
        self._name = name
        self._mode = mode
        self._host = host
        self._router = router
        self._replies = replies
        self._state = state
        #: Dead letters of every stage, newest last (the bus's ``dead_letters``).
        self.queue = DeadLetterQueue(
            ttl=ttl,
            maxlen=maxlen,
            resend=self.resend,
            on_add=self.announce,
            on_remove=mode.forget,
            clock=clock,
            before_replay=self.check_replay,
        )

    def record(
        self,
        envelope: Envelope,
        reason: DeadLetterReason,
        error: str | None,
        stage: str | None,
        attempts: int,
        cause: BaseException | None = None,
        *,
        stored: bool = False,
    ) -> DeadLetter | None:
        """Record ``envelope`` as dead (called by stages, consumers and middleware).

        :param stored: the broker stores it itself (a delivery will be rejected);
            otherwise the mode is asked to keep it.
        :return: the entry, ``None`` for a ``$deadletter`` envelope (never re-queued).
        """
        if envelope.topic == DEADLETTER_TOPIC:
            self._host.failure_log.discarded(envelope, reason, error, stage, attempts, cause)
            return None
        trace = None
        if cause is not None and reason is DeadLetterReason.HANDLER_FAILED:
            trace = short_traceback(cause)
        entry = DeadLetter(envelope, reason, error, stage, attempts, time.time(), trace)
        self._host.failure_log.dead_lettered(entry, cause)
        self.queue.add(entry)
        if not stored:
            self._mode.store(entry)
        self._replies.fail(entry, cause)
        return entry

    # -- $deadletter ------------------------------------------------------------

    def announce(self, entry: DeadLetter) -> None:
        """Publish ``entry`` on ``$deadletter`` to this process's subscribers."""
        if self._state() not in ("running", "closing"):
            return
        stages = self._router.route(DEADLETTER_TOPIC)
        if not stages:
            return
        envelope = Envelope(
            topic=DEADLETTER_TOPIC,
            payload=entry,
            correlation_id=entry.envelope.correlation_id,
            causation_id=entry.envelope.id,
            sender=self._name,
        )
        instrumentation = self._host.instrumentation
        if instrumentation is None:
            self._announce_to(stages, envelope)
        else:  # (announcements stay in this process, whatever the transport)
            _instrument.send_now(
                instrumentation,
                "dead_letter",
                envelope,
                "memory",
                lambda envelope: self._announce_to(stages, envelope),
            )

    def _announce_to(self, stages: tuple[Stage, ...], envelope: Envelope) -> Receipt:
        for stage in stages:
            if stage.offer(envelope) is DoorOutcome.BLOCKED:
                self._host.start_background(self._put_later, stage, envelope)
        return make_receipt(envelope.id, tuple(stage.name for stage in stages))

    async def _put_later(self, stage: Stage, envelope: Envelope) -> None:
        try:
            await stage.put(envelope)
        except BusClosedError:
            # Never admitted, so not in any ledger: only the announcement is lost.
            logger.warning("$deadletter announcement of %s dropped at shutdown", envelope.id)

    # -- replay -----------------------------------------------------------------

    def check_replay(self) -> None:
        """Raise :class:`BusClosedError` unless a replay may be sent now.

        As a publish: refused once ``aclose`` began, but from the bus's own handlers
        (the entry stays in the queue).
        """
        state = self._state()
        if not (state == "running" or (state == "closing" and current_handling() is not None)):
            if state == "new":
                raise not_started("replay")
            raise BusClosedError(f"replay needs a running bus; the bus is {state}")

    async def resend(self, entry: DeadLetter) -> Receipt:
        """Replay ``entry``: ``attempt`` 1, marked replayed, to the stage that lost it."""
        self.check_replay()
        envelope = with_headers(
            entry.envelope.evolve(attempt=1, timestamp=time.time()), {HEADER_REPLAYED: "1"}
        )
        instrumentation = self._host.instrumentation
        if instrumentation is None:
            return await self._mode.replay(entry, envelope)
        return await _instrument.send(
            instrumentation,
            "replay",
            envelope,
            self._mode.system,
            lambda envelope, _: self._mode.replay(entry, envelope),
            None,
        )
