"""The bus's one instrumentation seam: what an instrumented bus tells an observer.

A bus holds ``_instrumentation``: ``None`` (then the hot path pays one attribute
check) or an :class:`Instrumentation`, told two things:

* :meth:`~Instrumentation.send`: an envelope leaves, as a publish (``publish_nowait``
  and ``publish_threadsafe`` included), a request, a slip hop, a reply, a replay or a
  ``$deadletter`` announcement. It runs in the sender's context (the handler's, for
  hops and replies) before the envelope is routed, and may replace it (to add
  headers); :meth:`~Instrumentation.sent` follows once routing returned or failed.
* :meth:`~Instrumentation.enter` / :meth:`~Instrumentation.exit`: around each
  dispatch, in the consumer's context, with the outcome at the exit (acked, a retry
  scheduled, dead-lettered with its reason, or abandoned by cancellation).

Tracing (``asyncbus.integrations.opentelemetry``) and the contextvars a bus carries to
its handlers (``Bus(propagate_contextvars=...)``) are instrumentations; several are
combined in the order they were attached (``_observe`` attaches them to a bus, and
holds what the integrations read of it).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from contextvars import Context
from dataclasses import dataclass
from typing import Any, Literal

from ._envelope import Envelope, Receipt
from ._exceptions import BusClosedError, PublishTimeout

__all__ = [
    "Consumer",
    "Instrumentation",
    "Result",
    "SendKind",
    "combine",
    "enter",
    "exit",
    "parts_of",
    "send",
    "send_many",
    "send_now",
]

logger = logging.getLogger("asyncbus.bus")

#: Why an envelope leaves: ``publish`` (every publish call), ``request``, ``forward``
#: (a slip hop), ``reply``, ``replay`` (a dead letter re-sent), ``dead_letter`` (the
#: ``$deadletter`` announcement, which stays in the process).
SendKind = Literal["publish", "request", "forward", "reply", "replay", "dead_letter"]
#: How a dispatch ended.
Settlement = Literal["acked", "skipped", "retry", "deferred", "dead_lettered", "abandoned"]


@dataclass(frozen=True, slots=True)
class Consumer:
    """Where a dispatch runs.

    :ivar stage: ``"pattern@group"``.
    :ivar system: the transport's name (``"memory"`` when envelopes stay in the stages).
    :ivar internal: the bus's own request inbox over a broker (not the user's stage).
    """

    stage: str
    pattern: str
    group: str
    system: str
    internal: bool


@dataclass(frozen=True, slots=True)
class Result:
    """How a dispatch ended.

    :ivar outcome: ``acked``, ``skipped`` (acked unhandled, e.g. a duplicate),
        ``retry`` (a retry is scheduled after ``delay`` s), ``deferred`` (put back by a
        ``Defer`` after ``delay`` s; not a failure), ``dead_lettered`` (with
        ``reason`` and ``error``) or ``abandoned`` (cancelled, e.g. at shutdown).
    :ivar exception: what failed the attempt (retry, dead letter, abandon), if anything.
    """

    outcome: Settlement
    delay: float | None = None
    reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None


class Instrumentation:
    """What an instrumented bus calls; every hook of this base does nothing.

    Hooks run on the event-loop thread, on the bus's hot path: they must be quick and
    must not raise (an exception from one is logged and otherwise ignored).
    """

    __slots__ = ()

    def send(self, kind: SendKind, envelope: Envelope, system: str) -> tuple[Envelope, object]:
        """An envelope is about to be routed; return it (or a copy) and a token for :meth:`sent`."""
        return envelope, None

    def sent(self, token: object, receipt: Receipt | None, error: BaseException | None) -> None:
        """Routing the envelope of ``token`` returned ``receipt`` or raised ``error``."""

    def enter(self, consumer: Consumer, envelope: Envelope) -> object:
        """A consumer starts handling ``envelope``; return a token for :meth:`exit`."""
        return None

    def exit(self, token: object, result: Result) -> None:
        """The dispatch of ``token`` ended with ``result``."""


class _Combined(Instrumentation):
    """Several instrumentations, in order (exits in reverse order)."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[Instrumentation, ...]) -> None:
        self.parts = parts

    def send(self, kind: SendKind, envelope: Envelope, system: str) -> tuple[Envelope, object]:
        tokens = []
        for part in self.parts:
            envelope, token = _send(part, kind, envelope, system)
            tokens.append(token)
        return envelope, tokens

    def sent(self, token: object, receipt: Receipt | None, error: BaseException | None) -> None:
        assert isinstance(token, list)
        for part, part_token in zip(reversed(self.parts), reversed(token), strict=True):
            _sent(part, part_token, receipt, error)

    def enter(self, consumer: Consumer, envelope: Envelope) -> object:
        tokens = []
        for part in self.parts:
            try:
                tokens.append(part.enter(consumer, envelope))
            except Exception:
                logger.exception("asyncbus instrumentation %r failed on enter", part)
                tokens.append(_FAILED)
        return tokens

    def exit(self, token: object, result: Result) -> None:
        assert isinstance(token, list)
        for part, part_token in zip(reversed(self.parts), reversed(token), strict=True):
            if part_token is not _FAILED:
                _guard(part.exit, part_token, result)


def combine(parts: tuple[Instrumentation, ...]) -> Instrumentation | None:
    """One instrumentation calling each of ``parts`` in order (``None`` for none)."""
    return None if not parts else parts[0] if len(parts) == 1 else _Combined(parts)


def parts_of(instrumentation: Instrumentation | None) -> tuple[Instrumentation, ...]:
    """The instrumentations :func:`combine` made ``instrumentation`` of."""
    if instrumentation is None:
        return ()
    return instrumentation.parts if isinstance(instrumentation, _Combined) else (instrumentation,)


def _guard(hook: Callable[..., None], *arguments: Any) -> None:
    try:
        hook(*arguments)
    except Exception:  # an observer's bug must not break the bus
        logger.exception("asyncbus instrumentation hook %r failed", hook)


# -- what the bus calls -----------------------------------------------------------

#: The token of a hook that raised: its pair is not called.
_FAILED: Any = object()


def _send(
    instrumentation: Instrumentation, kind: SendKind, envelope: Envelope, system: str
) -> tuple[Envelope, object]:
    try:
        return instrumentation.send(kind, envelope, system)
    except Exception:  # an observer's bug must not stop the publish
        logger.exception("asyncbus instrumentation %r failed on send", instrumentation)
        return envelope, _FAILED


def _sent(
    instrumentation: Instrumentation,
    token: object,
    receipt: Receipt | None,
    error: BaseException | None,
) -> None:
    if token is not _FAILED:
        _guard(instrumentation.sent, token, receipt, error)


async def send(
    instrumentation: Instrumentation,
    kind: SendKind,
    envelope: Envelope,
    system: str,
    route: Callable[[Envelope, float | None], Awaitable[Receipt]],
    timeout: float | None,
    context: Context | None = None,
) -> Receipt:
    """``await route(envelope, timeout)``, told to ``instrumentation`` before and after.

    :param context: where the send was made, when not here (``publish_threadsafe``).
    """
    if context is None:
        envelope, token = _send(instrumentation, kind, envelope, system)
    else:
        envelope, token = context.run(_send, instrumentation, kind, envelope, system)
    try:
        receipt = await route(envelope, timeout)
    except BaseException as error:  # cancelled too: what the send opened must close
        _sent(instrumentation, token, None, error)
        raise
    _sent(instrumentation, token, receipt, None)
    return receipt


async def send_many(
    instrumentation: Instrumentation,
    kind: SendKind,
    envelopes: Sequence[Envelope],
    system: str,
    route: Callable[[Sequence[Envelope], float | None], Awaitable[list[Receipt]]],
    timeout: float | None,
) -> list[Receipt]:
    """``await route(envelopes, timeout)``, each envelope told to ``instrumentation`` as
    a send of its own (before, in order, and after, with its own receipt).

    When routing fails part-way, the envelopes sent before the failure (the error's
    ``receipts``) are told their receipts, the others the error.
    """
    sends = [_send(instrumentation, kind, envelope, system) for envelope in envelopes]
    try:
        receipts = await route([envelope for envelope, _ in sends], timeout)
    except BaseException as error:  # cancelled too: what the sends opened must close
        done: Sequence[Receipt] = (
            error.receipts if isinstance(error, PublishTimeout | BusClosedError) else ()
        )
        for index, (_, token) in enumerate(sends):
            if index < len(done):
                _sent(instrumentation, token, done[index], None)
            else:
                _sent(instrumentation, token, None, error)
        raise
    for (_, token), receipt in zip(sends, receipts, strict=True):
        _sent(instrumentation, token, receipt, None)
    return receipts


def send_now(
    instrumentation: Instrumentation,
    kind: SendKind,
    envelope: Envelope,
    system: str,
    route: Callable[[Envelope], Receipt],
) -> Receipt:
    """``route(envelope)`` (routing that never waits), told to ``instrumentation``."""
    envelope, token = _send(instrumentation, kind, envelope, system)
    try:
        receipt = route(envelope)
    except BaseException as error:
        _sent(instrumentation, token, None, error)
        raise
    _sent(instrumentation, token, receipt, None)
    return receipt


def enter(instrumentation: Instrumentation, consumer: Consumer, envelope: Envelope) -> object:
    """``instrumentation.enter(consumer, envelope)``; a token that skips the exit if it raised."""
    try:
        return instrumentation.enter(consumer, envelope)
    except Exception:  # an observer's bug must not stop the dispatch
        logger.exception("asyncbus instrumentation %r failed on enter", instrumentation)
        return _FAILED


def exit(instrumentation: Instrumentation, token: object, result: Result) -> None:
    """``instrumentation.exit(token, result)``, unless its enter raised."""
    if token is not _FAILED:
        _guard(instrumentation.exit, token, result)
