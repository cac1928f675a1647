"""What the bus tells operators: one logger hierarchy, structured fields, rate limits.

Every record about an envelope that was not acked goes through the bus's one
:class:`FailureLog`, so the wording, levels and ``extra=`` fields live here and the
core calls it from a few places only:

* an attempt failed and will be retried: ``asyncbus.stage``, DEBUG, with the
  exception (reason ``retrying``);
* dead-lettered, for any reason: ``asyncbus.dead_letters``, WARNING (reason: the
  dead letter's); a handler's own failure (``handler_failed``) carries its traceback;
  a ``$deadletter`` envelope that fails is discarded instead, told the same way;
* turned away at a full ``REJECT`` stage's door: ``asyncbus.stage``, WARNING
  (reason ``rejected_at_door``);
* abandoned at shutdown: ``asyncbus.stage``, WARNING, one record per stage (reason
  ``abandoned``; the ids also in ``asyncbus_envelope_ids``).

Each record carries the fields :data:`FIELDS` (``None`` where one does not apply)
and ``asyncbus_suppressed``, so a JSON formatter or structlog picks them up. A record
that repeats (same event and stage, or same topic when no stage took the envelope)
is written at most once per :attr:`FailureLog.interval`; the next one written says
how many were suppressed in between, and closing the bus writes what is still
untold. Nothing here runs for an envelope that is acked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ._dead_letters import DeadLetter, DeadLetterReason

if TYPE_CHECKING:
    from ._envelope import Envelope

__all__ = ["FIELDS", "FailureLog"]

#: The structured fields every record carries in its ``extra``.
FIELDS = (
    "asyncbus_stage",
    "asyncbus_envelope_id",
    "asyncbus_topic",
    "asyncbus_attempt",
    "asyncbus_reason",
    "asyncbus_correlation_id",
)

stage_logger = logging.getLogger("asyncbus.stage")
dead_letter_logger = logging.getLogger("asyncbus.dead_letters")

#: Abandoned ids named in the message itself; all of them are in the ShutdownReport.
_NAMED_IDS = 10
#: Keys the rate limiter remembers before it forgets those whose interval has passed.
_MAX_KEYS = 1024


def _fields(
    stage: str | None, envelope: Envelope | None, attempt: int | None, reason: str
) -> dict[str, Any]:
    return {
        "asyncbus_stage": stage,
        "asyncbus_envelope_id": envelope.id if envelope is not None else None,
        "asyncbus_topic": envelope.topic if envelope is not None else None,
        "asyncbus_attempt": attempt,
        "asyncbus_reason": reason,
        "asyncbus_correlation_id": envelope.correlation_id if envelope is not None else None,
    }


class _Window:
    __slots__ = ("logger", "opened", "reason", "stage", "suppressed", "topic")

    def __init__(
        self,
        logger: logging.Logger,
        opened: float,
        reason: str,
        stage: str | None,
        topic: str | None,
    ) -> None:
        self.logger = logger
        self.opened = opened
        self.reason = reason
        self.stage = stage
        self.topic = topic
        self.suppressed = 0


class FailureLog:
    """The records one bus writes about envelopes that were not acked, rate-limited.

    :param interval: seconds during which a repeated record is counted, not written.
    :param clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, interval: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        # The bus calls it on its event loop; the lock keeps each window's count exact
        # should two threads ever write at once. Records are written outside it: a
        # window taken out of the dict is no one else's.
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str | None, str | None], _Window] = {}

    def _admit(
        self, logger: logging.Logger, reason: str, stage: str | None, topic: str | None
    ) -> int | None:
        """How many records were suppressed before this one, or ``None`` to suppress it."""
        key = (reason, stage, topic if stage is None else None)
        closed: list[_Window] = []
        with self._lock:
            now = self.clock()
            window = self._windows.get(key)
            if window is not None and now - window.opened < self.interval:
                window.suppressed += 1
                return None
            if window is None:
                if len(self._windows) >= _MAX_KEYS:
                    closed = self._forget_closed(now)
                self._windows[key] = _Window(logger, now, reason, stage, key[2])
                suppressed = 0
            else:
                suppressed, window.suppressed, window.opened = window.suppressed, 0, now
        for window in closed:
            self._tell_suppressed(window)
        return suppressed

    def _forget_closed(self, now: float) -> list[_Window]:
        # A flood over many distinct topics: forget each closed window (told by the
        # caller what it suppressed), so the limiter's memory stays bounded.
        closed = []
        for key, window in list(self._windows.items()):
            if now - window.opened >= self.interval:
                closed.append(window)
                del self._windows[key]
        return closed

    def _write(
        self,
        logger: logging.Logger,
        level: int,
        message: str,
        args: Sequence[object],
        extra: dict[str, Any],
        suppressed: int,
        exc_info: BaseException | None = None,
    ) -> None:
        if suppressed:
            message += " (%d similar records suppressed since the last one)"
            args = (*args, suppressed)
        extra["asyncbus_suppressed"] = suppressed
        logger.log(level, message, *args, extra=extra, exc_info=exc_info)

    # -- the events -------------------------------------------------------------

    def retrying(
        self, stage: str, envelope: Envelope, delay: float, error: BaseException | None
    ) -> None:
        """Attempt ``envelope.attempt`` failed in ``stage``; the next one is due after ``delay``."""
        if not stage_logger.isEnabledFor(logging.DEBUG):
            return
        suppressed = self._admit(stage_logger, "retrying", stage, envelope.topic)
        if suppressed is None:
            return
        described = f"{type(error).__name__}: {error}" if error is not None else "failed"
        self._write(
            stage_logger,
            logging.DEBUG,
            "attempt %d of envelope %s on topic %r failed in stage %r, retrying in %.3gs: %s",
            (envelope.attempt, envelope.id, envelope.topic, stage, delay, described),
            _fields(stage, envelope, envelope.attempt, "retrying"),
            suppressed,
            error,
        )

    def dead_lettered(self, entry: DeadLetter, cause: BaseException | None) -> None:
        """``entry`` entered the dead-letter queue; a handler's failure carries ``cause``."""
        if not dead_letter_logger.isEnabledFor(logging.WARNING):
            return
        envelope, reason = entry.envelope, entry.reason
        suppressed = self._admit(dead_letter_logger, reason.value, entry.stage, envelope.topic)
        if suppressed is None:
            return
        message = "dead-lettered %s: envelope %s on topic %r"
        args: list[object] = [reason.value, envelope.id, envelope.topic]
        if entry.stage is None:
            message += ", which no stage subscribes to"
        else:
            message += " in stage %r"
            args.append(entry.stage)
        if entry.error:
            if entry.stage is not None and entry.attempts:
                message += " after %d attempt(s)"
                args.append(entry.attempts)
            message += ": %s"
            args.append(entry.error)
        # The traceback only where it tells something: a handler's own exception.
        with_trace = cause if reason is DeadLetterReason.HANDLER_FAILED else None
        self._write(
            dead_letter_logger,
            logging.WARNING,
            message,
            args,
            _fields(entry.stage, envelope, entry.attempts, reason.value),
            suppressed,
            with_trace,
        )

    def discarded(
        self,
        envelope: Envelope,
        reason: DeadLetterReason,
        error: str | None,
        stage: str | None,
        attempts: int,
        cause: BaseException | None,
    ) -> None:
        """A ``$deadletter`` announcement failed in ``stage``: it is discarded, not re-queued.

        Written like a dead letter (same logger, level, fields and rate limit), since
        a dead letter never begets another one.
        """
        if not dead_letter_logger.isEnabledFor(logging.WARNING):
            return
        suppressed = self._admit(dead_letter_logger, reason.value, stage, envelope.topic)
        if suppressed is None:
            return
        message = "discarded %s: $deadletter envelope %s (about %s) in stage %r"
        args: list[object] = [reason.value, envelope.id, envelope.causation_id, stage]
        if error:
            if attempts:
                message += " after %d attempt(s)"
                args.append(attempts)
            message += ": %s"
            args.append(error)
        self._write(
            dead_letter_logger,
            logging.WARNING,
            message,
            args,
            _fields(stage, envelope, attempts, reason.value),
            suppressed,
            cause if reason is DeadLetterReason.HANDLER_FAILED else None,
        )

    def rejected_at_door(self, stage: str, capacity: int, envelope: Envelope) -> None:
        """A full ``REJECT`` stage turned ``envelope`` away."""
        if not stage_logger.isEnabledFor(logging.WARNING):
            return
        suppressed = self._admit(stage_logger, "rejected_at_door", stage, envelope.topic)
        if suppressed is None:
            return
        self._write(
            stage_logger,
            logging.WARNING,
            "stage %r is full (capacity %d): envelope %s on topic %r rejected at the door",
            (stage, capacity, envelope.id, envelope.topic),
            _fields(stage, envelope, envelope.attempt, "rejected_at_door"),
            suppressed,
        )

    def abandoned(self, stage: str, ids: Sequence[str]) -> None:
        """Shutdown cancelled ``ids`` in ``stage`` before they were settled (one record)."""
        if not ids or not stage_logger.isEnabledFor(logging.WARNING):
            return
        named = ", ".join(ids[:_NAMED_IDS])
        if len(ids) > _NAMED_IDS:
            named += f" and {len(ids) - _NAMED_IDS} more"
        extra = _fields(stage, None, None, "abandoned")
        extra["asyncbus_envelope_ids"] = tuple(ids)
        stage_logger.warning(
            "stage %r abandoned %d envelope(s) at shutdown: %s",
            stage,
            len(ids),
            named,
            extra=extra,
        )

    def flush(self) -> None:
        """Write what the rate limiter still holds back (when the bus closes)."""
        with self._lock:
            windows = list(self._windows.values())
            self._windows.clear()
        for window in windows:
            self._tell_suppressed(window)

    def _tell_suppressed(self, window: _Window) -> None:
        if not window.suppressed:
            return
        where = f"stage {window.stage!r}" if window.stage is not None else f"topic {window.topic!r}"
        extra = _fields(window.stage, None, None, window.reason)
        extra["asyncbus_topic"] = window.topic
        extra["asyncbus_suppressed"] = window.suppressed
        level = logging.DEBUG if window.reason == "retrying" else logging.WARNING
        window.logger.log(
            level,
            "%d more %s record(s) for %s were suppressed",
            window.suppressed,
            window.reason,
            where,
            extra=extra,
        )
        window.suppressed = 0
