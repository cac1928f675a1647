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
combined in the order they were attached. The integrations read the few internals they
need through the functions at the end of this module, so they depend on nothing else.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextvars import Context
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ._dispatch import Outcome, handler_failure
from ._envelope import make_envelope

if TYPE_CHECKING:
    from ._bus import Bus
    from ._dispatch import Dispatch
    from ._envelope import Envelope, Receipt
    from ._stage import Stage
    from ._stats import LatencyHistogram
    from ._types import Handler

__all__ = [
    "Consumer",
    "Instrumentation",
    "Result",
    "SendKind",
    "attach",
    "bus_state",
    "dead_letter_counts",
    "detach",
    "dispatch",
    "on_loop",
    "replace_headers",
    "send",
    "send_now",
    "set_headers",
    "stage_timings",
    "stages_subscribed",
    "system",
    "with_headers",
]

logger = logging.getLogger("asyncbus.bus")
T = TypeVar("T")

#: Why an envelope leaves: ``publish`` (every publish call), ``request``, ``forward``
#: (a slip hop), ``reply``, ``replay`` (a dead letter re-sent), ``dead_letter`` (the
#: ``$deadletter`` announcement, which stays in the process).
SendKind = Literal["publish", "request", "forward", "reply", "replay", "dead_letter"]
#: How a dispatch ended.
Settlement = Literal["acked", "skipped", "retry", "dead_lettered", "abandoned"]


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
        ``retry`` (a retry is scheduled after ``delay`` s), ``dead_lettered`` (with
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


def _guard(hook: Callable[..., None], *arguments: Any) -> None:
    try:
        hook(*arguments)
    except Exception:  # an observer's bug must not break the bus
        logger.exception("asyncbus instrumentation hook %r failed", hook)


def _parts(bus: Bus) -> tuple[Instrumentation, ...]:
    current = bus._instrumentation
    if current is None:
        return ()
    return current.parts if isinstance(current, _Combined) else (current,)


def _install(bus: Bus, parts: tuple[Instrumentation, ...]) -> None:
    bus._instrumentation = None if not parts else parts[0] if len(parts) == 1 else _Combined(parts)


def attach(bus: Bus, instrumentation: Instrumentation) -> None:
    """Make ``bus`` call ``instrumentation`` too (after those already attached).

    Dispatches already running finish with the instrumentations they started with.
    """
    _install(bus, (*_parts(bus), instrumentation))


def detach(bus: Bus, instrumentation: Instrumentation) -> None:
    """Stop ``bus`` calling ``instrumentation`` (nothing if it was not attached)."""
    _install(bus, tuple(part for part in _parts(bus) if part is not instrumentation))


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


# What each stage is, for the hooks: the same for its life (weak: it goes with its bus).
_consumers: weakref.WeakKeyDictionary[Stage, Consumer] = weakref.WeakKeyDictionary()


async def dispatch(
    instrumentation: Instrumentation, chain: Handler, dispatch: Dispatch, envelope: Envelope
) -> None:
    """Run ``chain(envelope)`` as a consumer does, between ``enter`` and ``exit``."""
    stage = dispatch.stage
    consumer = _consumers.get(stage)
    if consumer is None:
        bus = dispatch.bus
        consumer = _consumers[stage] = Consumer(
            stage.name,
            stage.pattern,
            stage.group,
            system(bus),
            stage.group == bus._inbox_prefix,
        )
    try:
        token = instrumentation.enter(consumer, envelope)
    except Exception:  # an observer's bug must not stop the dispatch
        logger.exception("asyncbus instrumentation %r failed on enter", instrumentation)
        token = _FAILED
    try:
        await chain(envelope)
    except Exception as error:  # the chain's outermost dead-letter layer, as in the consumer
        dispatch.fail(error)
    except BaseException as error:  # cancelled: the attempt is abandoned; close what opened
        failure = handler_failure(error)
        if failure is None:  # the bus's own cancellation (else a stray one: a failure)
            if token is not _FAILED:
                _guard(instrumentation.exit, token, Result("abandoned", exception=error))
            raise
        dispatch.fail(failure)
    if token is not _FAILED:
        _guard(instrumentation.exit, token, _result(dispatch))
    dispatch.cause = None  # (it holds the failed frames: let them go)


def _result(dispatch: Dispatch) -> Result:
    outcome = dispatch.outcome
    if outcome is None:
        return _ACKED
    if outcome is Outcome.SKIPPED:
        return _SKIPPED
    if outcome is Outcome.DEFERRED:
        return Result("retry", delay=dispatch.delay, exception=dispatch.cause)
    dead = dispatch.dead
    return Result(
        "dead_lettered",
        reason=dead.reason.value if dead is not None else None,
        error=dead.error if dead is not None else None,
        exception=dispatch.cause,
    )


_ACKED = Result("acked")
_SKIPPED = Result("skipped")


def system(bus: Bus) -> str:
    """The transport's name for what ``bus`` sends (``"memory"`` in its stages)."""
    broker = bus._broker
    return broker.name if broker is not None else "memory"


def with_headers(envelope: Envelope, extra: Mapping[str, str]) -> Envelope:
    """A copy of ``envelope`` whose headers also hold ``extra`` (replacing same names)."""
    return set_headers(envelope, {**envelope.headers, **extra})


def set_headers(envelope: Envelope, fields: dict[str, str]) -> Envelope:
    """A copy of ``envelope`` whose headers are ``fields`` (taken over, not copied).

    Values a bus carries in memory beside the headers (contextvars) are kept.
    """
    from ._carry import CarryingHeaders

    headers = envelope.headers
    if isinstance(headers, CarryingHeaders):
        return replace_headers(envelope, headers.with_fields(fields))
    return replace_headers(envelope, MappingProxyType(fields))


def replace_headers(envelope: Envelope, headers: Mapping[str, str]) -> Envelope:
    """A copy of ``envelope`` with ``headers`` (the same id: the same message)."""
    return make_envelope(
        envelope.id,
        envelope.topic,
        envelope.payload,
        headers,
        envelope.timestamp,
        envelope.ttl,
        envelope.attempt,
        envelope.slip,
        envelope.correlation_id,
        envelope.causation_id,
        envelope.reply_to,
        envelope.sender,
    )


# -- what the integrations read of the bus ------------------------------------------


def bus_state(bus: Bus) -> str:
    """``new``, ``running``, ``closing`` (aclose began: draining) or ``closed``."""
    return bus._state


def stages_subscribed(bus: Bus) -> bool:
    """Whether every stage's broker subscription exists (always, in memory)."""
    return all(
        stage.subscribed is None or stage.subscribed.is_set() for stage in bus._stages.values()
    )


def stage_timings(bus: Bus) -> dict[str, tuple[LatencyHistogram, LatencyHistogram]]:
    """Stage name -> (handling latency, queue wait) histograms, read-only."""
    return {stage.name: (stage.latency, stage.wait) for stage in bus._stages.values()}


def dead_letter_counts(bus: Bus) -> dict[tuple[str | None, str], int]:
    """Dead letters in the queue now per (stage, reason), without scanning it."""
    return {(stage, reason.value): n for (stage, reason), n in bus.dead_letters._counts().items()}


def on_loop(bus: Bus, read: Callable[[], T]) -> T:
    """``read()`` on the thread that runs ``bus`` (where its state lives), from any thread.

    A scrape made from another thread (a metrics server thread) waits for the loop to
    run it; on the loop thread, or when the bus is not running, it runs here.
    """
    portal = bus._portal
    if portal is None or threading.get_ident() == bus._loop_thread:
        return read()
    try:
        return portal.call(read)
    except RuntimeError:  # the portal stopped meanwhile: the bus is closing, nothing moves
        return read()
