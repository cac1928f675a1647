"""Batches: a subscription's handler run once for a list of envelopes.

:class:`Batch` is the configuration; :func:`batch_argument` reads what the handler
wants in its list (payloads, envelopes or decoded models); :func:`outcomes` turns what
one call of the handler did into one outcome per envelope; :class:`Gather` collects,
for a chain that runs per envelope, the envelopes that reached its innermost layer
into the one call (``_batching`` runs the consumers).
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import operator
import typing
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio

from ._checks import check_count
from ._dead_letters import DeadLetterReason
from ._decoding import payload_decoder
from ._envelope import Envelope
from ._exceptions import BatchError, ConfigurationError, HandlerTimeout
from ._verdicts import DeadLetterNow

__all__ = [
    "AllAcked",
    "Batch",
    "Failed",
    "Gather",
    "Member",
    "PartlyFailed",
    "batch_argument",
    "enter_member",
    "join",
    "outcomes",
    "unnamed",
]


@dataclass(frozen=True, slots=True)
class Batch:
    """Hand the handler a list of envelopes' payloads at a time: ``subscribe(..., batch=Batch())``.

    A consumer takes what is queued, up to ``max_size``; with fewer it waits up to
    ``max_wait`` seconds (the loop's clock) for more, then calls the handler once with
    the list, in queue order. Over a broker it stops waiting once the stage holds
    ``capacity`` deliveries (its subscription's prefetch): none comes before one is
    settled. The handler gets payloads, or envelopes when its first
    parameter is annotated ``list[Envelope]`` (or ``Sequence[Envelope]``), or decoded
    models when annotated ``list[SomeModel]``. Returning normally acks every envelope;
    raising fails every one (retried and dead-lettered each on its own); raising
    :class:`BatchError` fails only the positions it names.

    :ivar max_size: most envelopes in one call, an int ``>= 1`` (at most the stage's
        capacity).
    :ivar max_wait: seconds to wait for a batch to fill, finite and ``>= 0`` (``0``:
        take what is queued and go).
    :raises ConfigurationError: for a ``max_size`` that is not an int ``>= 1``, or a
        ``max_wait`` that is not a finite number ``>= 0``.
    """

    max_size: int = 100
    max_wait: float = 0.05

    def __post_init__(self) -> None:
        check_count(self.max_size, "Batch: max_size", 1)
        wait = self.max_wait
        if (
            isinstance(wait, bool)
            or not isinstance(wait, int | float)
            or not math.isfinite(wait)
            or wait < 0
        ):
            raise ConfigurationError(f"Batch: max_wait must be a finite number >= 0, got {wait!r}")
        object.__setattr__(self, "max_wait", float(wait))


#: How a batch handler's list is made from envelopes: ``None`` for the payloads.
Extract = Callable[[Envelope], Any] | None

_SEQUENCES = (list, collections.abc.Sequence, collections.abc.MutableSequence)


def batch_argument(handler: Any, where: str) -> Extract:
    """What each item of the handler's list is made from an envelope.

    ``None`` (the payload) when the first parameter is not annotated, or annotated
    ``list``/``Sequence`` of anything that is not a model; the envelope itself for
    ``list[Envelope]``; the payload decoded for ``list[Model]`` (a dataclass, a msgspec
    Struct or a pydantic model; an undecodable payload raises :class:`DecodeError`).

    :raises ConfigurationError: when the first parameter is annotated with something
        that is not a list or a sequence (``Envelope`` alone, say).
    """
    try:
        parameters = list(inspect.signature(handler).parameters.values())
    except (TypeError, ValueError):
        return None
    if not parameters or parameters[0].annotation is inspect.Parameter.empty:
        return None
    annotation: object = parameters[0].annotation
    if isinstance(annotation, str):
        written = annotation
        try:
            annotation = typing.get_type_hints(handler).get(parameters[0].name, written)
        except Exception:  # an annotation naming what is not importable here
            annotation = _written(written)
    if annotation is Any:
        return None
    origin = typing.get_origin(annotation) or annotation
    if origin not in _SEQUENCES and not (
        isinstance(origin, type) and origin in (typing.List, typing.Sequence)  # noqa: UP006
    ):
        raise ConfigurationError(
            f"{where}: a batch handler takes a list; its first parameter is annotated "
            f"{annotation!r} (annotate it list[...] or Sequence[...], or leave it bare)"
        )
    arguments = typing.get_args(annotation)
    item = arguments[0] if arguments else None
    if item is Envelope:
        return _identity
    decoder = payload_decoder(item)
    if decoder is None:
        return None
    return lambda envelope: decoder(envelope.payload)


def _written(annotation: str) -> object:
    """A string annotation that does not resolve, read as far as it can be."""
    text = annotation.replace(" ", "")
    for prefix in ("list[", "List[", "Sequence[", "typing.Sequence[", "abc.Sequence["):
        if text.startswith(prefix):
            inner = text[len(prefix) : -1].rpartition(".")[2]
            return list[Envelope] if inner == "Envelope" else list[Any]
    if text in ("list", "Sequence"):
        return list[Any]
    return annotation


def _identity(envelope: Envelope) -> Envelope:
    return envelope


class AllAcked(list[Any]):
    """The outcomes of a call that returned ``None``: every item acked, with no result."""

    __slots__ = ()


class Failed:
    """One envelope's outcome of a batch call: it failed with :attr:`error`."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class PartlyFailed(list[Any]):
    """The outcomes of a call that raised :class:`BatchError`: a :class:`Failed` for
    each position it names, ``None`` for the others (acked with no result: see
    :func:`unnamed`)."""

    __slots__ = ()


_NO_RESULT_FOR_THE_ROUTE = (
    "BatchError named no failure for this envelope, so it has no result, yet a routing "
    "slip or a requester waits for one: return a list with one result per item instead "
    "(a verdict, such as DeadLetterNow, for the ones that failed)"
)


def unnamed(envelope: Envelope) -> Any:
    """The outcome of an envelope whose position a :class:`BatchError` did not name:
    acked, with no result (``None``); but an envelope whose result goes on (a routing
    slip, a requester) needs one, so it is dead-lettered ``handler_failed`` at once,
    never forwarded as ``None`` (the handler did its work: a retry would do it again)."""
    if not envelope.slip and envelope.reply_to is None:
        return None
    return DeadLetterNow.for_failure(TypeError(_NO_RESULT_FOR_THE_ROUTE))


def outcomes(count: int, result: Any, error: BaseException | None) -> list[Any]:
    """What one batch call of ``count`` items means for each item.

    Each outcome is a :class:`Failed`, a :class:`DeadLetterNow` (the call returned what
    a batch handler cannot return) or the item's result (its return value, forwarded
    along its slip or to its requester as a per-message handler's would be; for a call
    that raised :class:`BatchError`, a :class:`PartlyFailed` list whose ``None`` items
    have no result: see :func:`unnamed`).
    """
    if error is not None:
        if isinstance(error, BatchError):
            failures: dict[int, Any] = {}
            wrong: list[Any] = []
            repeated: list[int] = []
            for given, failure in error.failures.items():
                # Any integer (numpy's too) names a position; a bool does not.
                position = _index(given)
                if position is None or not 0 <= position < count:
                    wrong.append(given)
                elif position in failures:
                    repeated.append(position)
                else:
                    failures[position] = failure
            # An envelope fails with an Exception; a value that is not one (a string, or
            # KeyboardInterrupt / CancelledError, never raised) would otherwise crash the
            # consumer or stop the bus.
            odd = [
                (position, failure)
                for position, failure in failures.items()
                if not isinstance(failure, Exception)
            ]
            invalid: Exception
            if wrong:
                invalid = ValueError(
                    f"BatchError names position(s) {', '.join(map(repr, wrong[:5]))}, but the "
                    f"batch handler was given {count} item(s) (positions 0 to {count - 1})"
                )
            elif repeated:
                invalid = ValueError(
                    f"BatchError names position(s) {', '.join(map(repr, repeated[:5]))} "
                    "more than once"
                )
            elif odd:
                invalid = TypeError(
                    "BatchError's failures must be exceptions (instances of Exception); "
                    + ", ".join(f"position {p!r} has {_what(f)}" for p, f in odd[:5])
                )
            else:
                each = PartlyFailed([None] * count)
                for position, failure in failures.items():
                    each[position] = Failed(failure)
                return each
            invalid.__cause__ = error
            error = invalid
        return [Failed(error)] * count
    if result is None:
        return AllAcked([None] * count)
    if isinstance(result, list | tuple) and len(result) == count:
        return list(result)
    wrong_return = TypeError(
        f"the batch handler returned {_short(result)}; it must return None or a list with "
        f"one result per item ({count})"
    )
    verdict = DeadLetterNow(
        DeadLetterReason.HANDLER_FAILED, f"TypeError: {wrong_return}", wrong_return
    )
    return [verdict] * count


def _index(position: object) -> int | None:
    """``position`` as a list index, ``None`` when it is no integer (or a bool)."""
    if isinstance(position, bool):
        return None
    try:
        return operator.index(position)  # type: ignore[arg-type]
    except TypeError:
        return None


def _what(failure: object) -> str:
    """A failure that is not an ``Exception``, for an error message."""
    if isinstance(failure, BaseException):
        return f"a {type(failure).__name__}"
    return _short(failure)


def _short(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


#: ``call(items)``: the user's function called once with a list (timeout included);
#: the outcome per item, see :func:`outcomes`.
BatchCall = Callable[[list[Any]], Awaitable[list[Any]]]


class Gather:
    """One batch whose envelopes each run the chain; the innermost layer joins them here.

    The consumer starts one task per envelope and waits until every one either
    reached the innermost layer (:func:`join`) or finished without it (expired, a
    duplicate, a middleware's verdict); then it calls the handler once with the items
    that joined, in queue order, and hands each its outcome.

    Only envelopes whose chain still waits for the call are in it: one whose wait
    ended before the call (its ``timeout()`` or any deadline of its own middleware:
    it is retried or dead-lettered) is left out. Once the call has them, their
    outcome is the call's; the call runs until the earliest deadline among them
    (then every one fails with :class:`HandlerTimeout`, as a per-message handler is
    cancelled at its timeout), so no envelope the ledger counts as failed is handled.

    :param inherited: the consumer's own deadline, which every envelope's task has too
        (not a deadline of the envelope's chain).
    """

    __slots__ = (
        "deadlines",
        "done",
        "inherited",
        "items",
        "joined",
        "left",
        "open",
        "outcomes",
        "partly",
        "ready",
        "size",
        "waits",
    )

    def __init__(self, size: int, inherited: float) -> None:
        self.size = size
        self.inherited = inherited
        #: Tasks that neither joined nor finished yet.
        self.left = size
        self.items: dict[int, Any] = {}
        #: The deadline of each joined envelope's chain (``inf``: none of its own).
        self.deadlines: dict[int, float] = {}
        #: The scope each joined envelope waits in (shielded once the call has it).
        self.waits: dict[int, anyio.CancelScope] = {}
        #: Positions that joined (a task that joined is no longer counted in ``left``).
        self.joined: set[int] = set()
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.outcomes: dict[int, Any] = {}
        #: Whether the call raised BatchError: an outcome ``None`` has no result then.
        self.partly = False
        self.open = True
        if not size:
            self.ready.set()

    def arrive(self, position: int, item: Any, deadline: float, waiting: anyio.CancelScope) -> None:
        """The envelope at ``position`` reached the innermost layer with ``item``; its
        chain must end by ``deadline``; it waits for the call in ``waiting``."""
        self.items[position] = item
        self.deadlines[position] = deadline if deadline < self.inherited else math.inf
        self.waits[position] = waiting
        self.joined.add(position)
        self._count_down()

    def withdraw(self, position: int) -> None:
        """The chain at ``position`` stopped waiting before the call: leave it out."""
        if self.open:
            self.items.pop(position, None)
            self.deadlines.pop(position, None)

    def finished(self, position: int) -> None:
        """The chain of the envelope at ``position`` ended (joined or not)."""
        if self.open and position not in self.joined:
            self.joined.add(position)  # (counted once)
            self._count_down()

    def _count_down(self) -> None:
        self.left -= 1
        if not self.left:
            self.ready.set()

    async def run(self, call: BatchCall) -> None:
        """Call the handler once with the items still waiting, then release their chains."""
        self.open = False
        try:
            now = anyio.current_time()
            # A chain whose deadline has passed is on its way out (timed out) even if
            # its task has not run since: it is not handed over.
            positions = sorted(p for p, deadline in self.deadlines.items() if deadline > now)
            if not positions:
                return
            for position in positions:
                self.waits[position].shield = True  # the call has it: its outcome is the call's
            deadline = min(self.deadlines[position] for position in positions)
            with anyio.CancelScope(deadline=deadline) as late:
                each = await call([self.items[position] for position in positions])
            if late.cancelled_caught:
                timed_out = Failed(
                    HandlerTimeout(
                        "the batch handler was still running at the deadline of an envelope "
                        "in its batch"
                    )
                )
                each = [timed_out] * len(positions)
            self.outcomes = dict(zip(positions, each, strict=True))
            self.partly = isinstance(each, PartlyFailed)
        finally:
            # (Should the call raise, the bus is stopping: the members, released without
            # an outcome, stay parked until they are cancelled with it.)
            self.done.set()


class Member:
    """A task's place in its batch (set in the task's context by the consumer)."""

    __slots__ = ("gather", "position")

    def __init__(self, gather: Gather, position: int) -> None:
        self.gather = gather
        self.position = position


_member: ContextVar[Member | None] = ContextVar("asyncbus_batch_member", default=None)


def enter_member(gather: Gather, position: int) -> None:
    """Make the calling task the member at ``position`` of ``gather``."""
    _member.set(Member(gather, position))


async def join(envelope: Envelope, item: Any, call: BatchCall) -> Any:
    """The innermost layer's call: wait for the batch, return or raise the outcome of
    ``envelope``'s ``item``.

    Called outside a batch, or again after its batch ran (a middleware that calls
    ``call_next`` twice), the handler is called with this item alone.
    """
    member = _member.get()
    if member is None or not member.gather.open or member.position in member.gather.joined:
        each = await call([item])
        outcome, partly = each[0], isinstance(each, PartlyFailed)
    else:
        gather = member.gather
        position = member.position
        with anyio.CancelScope() as waiting:
            gather.arrive(position, item, anyio.current_effective_deadline(), waiting)
            try:
                await gather.done.wait()
            except BaseException:  # deliberate: a chain that stops waiting is not in the call
                gather.withdraw(position)
                raise
        if position not in gather.outcomes:
            # Not in the call (its deadline had passed), or the call was cut off (the
            # bus is stopping): never released without an outcome; cancelled soon.
            await anyio.sleep_forever()
        outcome, partly = gather.outcomes[position], gather.partly
    if isinstance(outcome, Failed):
        raise outcome.error
    if outcome is None and partly:
        return unnamed(envelope)
    return outcome
