"""Verdicts: what a middleware decides for the envelope in hand; the consumer acts on it.

A layer of the chain (a built-in, a user's middleware or the handler itself) that
wants the envelope settled otherwise than by an ack *returns* one of these instead
of a result. Every layer outside it sees the verdict as the result of
``call_next`` and passes it outward unchanged (``routing_slip`` forwards nothing for
it, ``deduplicate`` does not remember the envelope as handled), and the stage's
consumer carries it out in one place:

* :class:`Skip`: ack the envelope, as handled, without forwarding anything;
* :class:`RetryAfter`: count the attempt as failed and re-enter the envelope into its
  own stage after ``delay`` seconds (``attempt`` + 1), without holding a consumer;
* :class:`Defer`: put the envelope back into its own stage after ``delay`` seconds, with
  the same ``attempt``: not a failure and not an attempt (``deferred`` in the ledger);
* :class:`DeadLetterNow`: dead-letter it with ``reason`` (the stage's ledger, the
  dead-letter queue, ``$deadletter``, a waiting requester and, over a broker, the
  delivery's reject all follow from it).

A chain that returns anything else, ``None`` included, acks the envelope. An
exception that escapes the whole chain is dead-lettered as by
:meth:`DeadLetterNow.for_failure`.
"""

from __future__ import annotations

from dataclasses import dataclass

import anyio

from ._checks import check_seconds
from ._dead_letters import DeadLetterReason
from ._exceptions import ConfigurationError, DecodeError, HandlerTimeout, Reject
from ._failures import describe_error, handler_failure

__all__ = [
    "DeadLetterNow",
    "Defer",
    "GiveBack",
    "RetryAfter",
    "Skip",
    "Verdict",
    "escaped_verdict",
]


class Verdict:
    """Base of the verdicts a middleware returns to have the consumer settle otherwise."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Skip(Verdict):
    """Ack the envelope as handled, and forward nothing (a duplicate, say)."""


@dataclass(frozen=True, slots=True)
class RetryAfter(Verdict):
    """Retry the envelope in its own stage after ``delay`` seconds.

    The attempt counts as failed (``failed`` and ``retried`` in the stage's ledger);
    the envelope stays in flight while it waits, and comes back with ``attempt`` + 1.

    :ivar delay: seconds to wait, finite and ``>= 0``.
    :ivar cause: the failure that made the attempt fail (logged at DEBUG, and told to
        an instrumented bus's observers), if any.
    :raises ConfigurationError: for a delay that is not a finite number ``>= 0``.
    """

    delay: float
    cause: BaseException | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "delay", check_seconds(self.delay, "RetryAfter", zero=True))


@dataclass(frozen=True, slots=True)
class Defer(Verdict):
    """Handle the envelope later: back into its own stage after ``delay`` seconds.

    Not a failure and not an attempt: ``deferred`` counts it in the stage's ledger
    (``failed`` and ``retried`` do not move), it comes back with the same ``attempt``
    (so ``Retry``'s budget and a broker's ``max_deliveries`` are untouched), and it
    stays in flight while it waits, holding no consumer. Its expiry still applies: one
    whose ``ttl`` passes meanwhile is dead-lettered ``expired`` when it comes back. For
    a rate limiter, say, that lets an envelope wait for its turn. Deferring for ever
    is deferring for ever: nothing bounds how often an envelope is deferred.

    :ivar delay: seconds to wait, finite and ``>= 0``.
    :raises ConfigurationError: for a delay that is not a finite number ``>= 0``.
    """

    delay: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "delay", check_seconds(self.delay, "Defer", zero=True))


@dataclass(frozen=True, slots=True)
class GiveBack(Verdict):
    """Leave the envelope unhandled and unsettled, for the broker to deliver again
    (the bus's own: the partition it came from is no longer this process's).

    It ends here as ``abandoned``; its subscription, ended already, released it.
    """


@dataclass(frozen=True, slots=True)
class DeadLetterNow(Verdict):
    """Dead-letter the envelope now, with ``reason``.

    :ivar reason: a :class:`DeadLetterReason` (or its string value).
    :ivar error: what :attr:`DeadLetter.error` says (``None`` when the reason says it all).
    :ivar cause: the handler's exception, when the attempt failed: the attempt is then
        counted ``failed``, a ``handler_failed`` entry keeps its last frames, and a
        waiting requester's :class:`HandlerError` has it as ``__cause__``.
    :raises ConfigurationError: for a reason that is not a :class:`DeadLetterReason`.
    """

    reason: DeadLetterReason
    error: str | None = None
    cause: BaseException | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.reason, DeadLetterReason):
            try:
                reason = DeadLetterReason(self.reason)
            except ValueError:
                raise ConfigurationError(
                    f"DeadLetterNow: reason must be a DeadLetterReason, got {self.reason!r}"
                ) from None
            object.__setattr__(self, "reason", reason)

    @classmethod
    def for_failure(cls, error: BaseException) -> DeadLetterNow:
        """The verdict for a handler that raised ``error``, as the built-in ``dead_letter`` gives.

        ``Reject(reason)`` and a :class:`DecodeError` are ``rejected``, a
        :class:`HandlerTimeout` is ``timeout``, anything else ``handler_failed``; the
        error text is ``"Type: message"`` (``"Reject: reason"`` for a rejection).
        """
        if isinstance(error, Reject):
            return cls(DeadLetterReason.REJECTED, f"Reject: {error.reason}", error)
        if isinstance(error, DecodeError):
            return cls(DeadLetterReason.REJECTED, f"DecodeError: {error}", error)
        if isinstance(error, HandlerTimeout):
            return cls(DeadLetterReason.TIMEOUT, describe_error(error), error)
        return cls(DeadLetterReason.HANDLER_FAILED, describe_error(error), error)


def escaped_verdict(error: BaseException) -> DeadLetterNow | None:
    """The verdict for ``error``, which escaped a chain: the bus's one failure decision.

    A failure (an ``Exception``, ``GeneratorExit``, a cancellation that is not the bus's:
    see :func:`handler_failure`) is :meth:`DeadLetterNow.for_failure`'s dead letter.
    ``None`` for ``KeyboardInterrupt``, ``SystemExit`` and any other ``BaseException``:
    not a verdict, the consumer stops the bus with it.

    :raises: ``error`` itself when it is the bus's own cancellation.
    """
    failure = handler_failure(error)
    if failure is not None:
        return DeadLetterNow.for_failure(failure)
    if isinstance(error, anyio.get_cancelled_exc_class()):
        raise error
    return None
