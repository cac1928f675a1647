"""A subscription's configuration, validated when ``subscribe`` is called."""

from __future__ import annotations

import functools
import inspect
import itertools
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ._adaptive import Adaptive
from ._admission import Admission
from ._backpressure import Backpressure
from ._batch import Batch, batch_argument
from ._checks import MAX_COUNT, check_count, check_seconds
from ._exceptions import ConfigurationError
from ._ordering import KEY_FAILURES, ORDERINGS, KeyFailure, Ordering
from ._routing import compile_pattern
from ._types import Middleware
from .middleware.retry import Retry

__all__ = [
    "Offload",
    "StageOptions",
    "Subscription",
    "check_middleware",
    "check_options",
    "default_group",
    "make_subscription",
    "stage_options",
    "unwrap_partial",
]

Offload = Literal["thread", "process", "inline"]
_OFFLOADS = ("thread", "process", "inline")
_unique = itertools.count(1)
#: The most partitions an ordered group may be split into.
MAX_PARTITIONS = 4096


@dataclass(frozen=True, slots=True)
class StageOptions:
    """What every subscription of one group shares: the shape of their stage.

    The first subscription to a group makes the stage from these; each later one must
    ask for the same (:meth:`conflict`), since one queue, one door and one ordering
    serve them all. What one subscription's own chain uses (its handler, retry,
    timeout, offload, middleware, batch and consumers) stays on the
    :class:`Subscription`.
    """

    capacity: int
    backpressure: Backpressure
    #: Sojourn shedding of the stage, ``None`` for none.
    admission: Admission | None = None
    #: Whether its concurrency is :class:`Adaptive` (the stage is then controlled).
    adaptive: bool = False
    #: ``"key"``: envelopes of one publish key one at a time, in order; ``None``: unordered.
    ordering: Ordering | None = None
    #: On an ordered stage, what a dead letter does to its key's waiting envelopes.
    key_failure: KeyFailure = "continue"
    #: The most handlers of the stage running at once in every replica together.
    max_in_flight: int | None = None
    #: An ordered group's partitions (over a broker); ``None`` when not given.
    partitions: int | None = None

    @property
    def controlled(self) -> bool:
        """Whether the stage runs under a controller (adaptive concurrency or shedding)."""
        return self.adaptive or self.admission is not None

    def conflict(self, joining: StageOptions, stage: str) -> str | None:
        """Why a subscription asking for ``joining`` cannot join ``stage``, made with
        these options; ``None`` when it can."""
        for names in _MUST_MATCH:
            has = tuple(getattr(self, name) for name in names)
            asks = tuple(getattr(joining, name) for name in names)
            if has != asks:
                shown = _listed(names, has)
                wanted = _listed(names, asks)
                return (
                    f"stage {stage!r} already has {shown}; a subscription in the same group "
                    f"asked for {wanted}"
                )
        if joining.adaptive and not self.controlled:
            return (
                f"stage {stage!r} runs a fixed concurrency; a subscription in the same "
                "group cannot be Adaptive (give the group's first subscription Adaptive or "
                "admission=)"
            )
        return None


#: The options a joining subscription must share with its stage, in the order checked
#: (the ones shown together in one message grouped).
_MUST_MATCH = (
    ("partitions",),
    ("max_in_flight",),
    ("ordering", "key_failure"),
    ("capacity", "backpressure"),
    ("admission",),
)


def _listed(names: tuple[str, ...], values: tuple[object, ...]) -> str:
    return ", ".join(_shown(name, value) for name, value in zip(names, values, strict=True))


def _shown(name: str, value: object) -> str:
    if isinstance(value, Backpressure):
        return f"{name}={value.name}"
    if name == "capacity":
        return f"{name}={value}"
    return f"{name}={value!r}"


@dataclass(frozen=True, slots=True, eq=False)
class Subscription:
    """One handler registered on a topic pattern; returned by ``bus.subscribe(topic, handler)``.

    What its group's stage shares is :attr:`stage_options` (also readable by name:
    ``capacity``, ``backpressure``, ``admission``, ``ordering``, ``key_failure``,
    ``max_in_flight``, ``partitions``); the other fields are this subscription's own.

    :ivar stage: the name of the stage it belongs to, ``"pattern@group"``.
    """

    topic: str
    handler: Callable[..., Any]
    group: str
    concurrency: int | Adaptive
    retry: Retry | None
    timeout: float | None
    offload: Offload | None
    middleware: tuple[Middleware, ...]
    #: What every subscription of the group shares: the stage's shape.
    stage_options: StageOptions
    #: Hand the handler lists of envelopes' items, ``None`` for one at a time.
    batch: Batch | None = None

    @property
    def stage(self) -> str:
        """Name of the stage this subscription feeds: ``"pattern@group"``."""
        return f"{self.topic}@{self.group}"

    @property
    def capacity(self) -> int:
        """The stage's bound (its group's)."""
        return self.stage_options.capacity

    @property
    def backpressure(self) -> Backpressure:
        """What a publish meets when the stage is full (its group's)."""
        return self.stage_options.backpressure

    @property
    def admission(self) -> Admission | None:
        """The stage's sojourn shedding, ``None`` for none (its group's)."""
        return self.stage_options.admission

    @property
    def ordering(self) -> Ordering | None:
        """``"key"`` for per-key order, ``None`` unordered (its group's)."""
        return self.stage_options.ordering

    @property
    def key_failure(self) -> KeyFailure:
        """On an ordered stage, what a dead letter does to its key (its group's)."""
        return self.stage_options.key_failure

    @property
    def max_in_flight(self) -> int | None:
        """The most handlers running at once in every replica together (its group's)."""
        return self.stage_options.max_in_flight

    @property
    def partitions(self) -> int | None:
        """An ordered group's partitions over a broker (its group's)."""
        return self.stage_options.partitions


def default_group(handler: Callable[..., Any]) -> str:
    """``module:qualname`` of ``handler``, made unique where that names no one handler.

    Lambdas and nested functions (``<`` in the qualname) and callables without a
    qualname of their own (``functools.partial``, instances with ``__call__``) get a
    group unique to the subscription: two of them are two handlers, so pub/sub.
    """
    module = getattr(handler, "__module__", None) or "?"
    own = getattr(handler, "__qualname__", None)
    qualname = own or type(handler).__qualname__
    group = f"{module}:{qualname}"
    if own is None or "<" in qualname:
        group += f"#{next(_unique)}"
    return group


def make_subscription(
    topic: str,
    handler: Any,
    *,
    group: str | None,
    concurrency: int | Adaptive,
    capacity: int,
    backpressure: Backpressure | str,
    retry: Retry | None,
    timeout: float | None,
    offload: str | None,
    middleware: Sequence[Middleware],
    admission: Admission | None = None,
    batch: Batch | None = None,
    ordering: str | None = None,
    key_failure: str = "continue",
    max_in_flight: int | None = None,
    partitions: int | None = None,
) -> Subscription:
    """Validate everything ``subscribe`` was given and return the :class:`Subscription`.

    :raises ConfigurationError: naming the argument that cannot work.
    """
    compile_pattern(topic)
    where = f"subscribe({topic!r})"
    _check_handler(handler, where)
    policy, seconds, layers = check_options(
        topic,
        group=group,
        concurrency=concurrency,
        capacity=capacity,
        backpressure=backpressure,
        retry=retry,
        timeout=timeout,
        offload=offload,
        middleware=middleware,
        admission=admission,
        batch=batch,
        ordering=ordering,
        key_failure=key_failure,
        max_in_flight=max_in_flight,
        partitions=partitions,
    )
    if batch is not None:
        batch_argument(handler, where)  # a first parameter annotated but not a list
    is_async = _is_async(handler)
    if is_async and offload in ("thread", "process"):
        raise ConfigurationError(f"{where}: offload={offload!r} needs a sync handler")
    return Subscription(
        topic=topic,
        handler=handler,
        group=group if group is not None else default_group(handler),
        concurrency=concurrency,
        retry=retry,
        timeout=seconds,
        offload=None if is_async else typing.cast("Offload", offload or "thread"),
        middleware=layers,
        stage_options=stage_options(
            capacity=capacity,
            backpressure=policy,
            admission=admission,
            concurrency=concurrency,
            ordering=ordering,
            key_failure=key_failure,
            max_in_flight=max_in_flight,
            partitions=partitions,
        ),
        batch=batch,
    )


def stage_options(
    *,
    capacity: int,
    backpressure: Backpressure,
    admission: Admission | None,
    concurrency: int | Adaptive,
    ordering: str | None,
    key_failure: str,
    max_in_flight: int | None,
    partitions: int | None,
) -> StageOptions:
    """The :class:`StageOptions` of a subscription given these (already checked)."""
    return StageOptions(
        capacity=capacity,
        backpressure=backpressure,
        admission=admission,
        adaptive=isinstance(concurrency, Adaptive),
        ordering=typing.cast("Ordering | None", ordering),
        key_failure=typing.cast("KeyFailure", key_failure),
        max_in_flight=max_in_flight,
        partitions=partitions,
    )


def check_options(
    topic: str,
    *,
    group: str | None,
    concurrency: int | Adaptive,
    capacity: int,
    backpressure: Backpressure | str,
    retry: Retry | None,
    timeout: float | None,
    offload: str | None,
    middleware: Sequence[Middleware],
    admission: Admission | None = None,
    batch: Batch | None = None,
    ordering: str | None = None,
    key_failure: str = "continue",
    max_in_flight: int | None = None,
    partitions: int | None = None,
) -> tuple[Backpressure, float | None, tuple[Middleware, ...]]:
    """Validate ``subscribe``'s options, all but what depends on the handler.

    The decorator form checks them when ``subscribe(...)`` is called, before any
    handler is given, exactly as the direct form does.

    :return: the back-pressure policy, the timeout in seconds and the middleware.
    :raises ConfigurationError: naming the argument that cannot work.
    """
    compile_pattern(topic)
    where = f"subscribe({topic!r})"
    for name, value in (("concurrency", concurrency), ("capacity", capacity)):
        if name == "concurrency" and isinstance(value, Adaptive):
            continue  # validated when it was made
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
            raise ConfigurationError(
                f"{where}: {name} must be an int >= 1"
                + (" or an Adaptive" if name == "concurrency" else "")
                + f", got {value!r}"
            )
    if admission is not None and not isinstance(admission, Admission):
        raise ConfigurationError(
            f"{where}: admission must be an Admission or None, got {admission!r}"
        )
    try:
        policy = Backpressure(backpressure)
    except ValueError:
        raise ConfigurationError(
            f"{where}: backpressure must be a Backpressure, got {backpressure!r}"
        ) from None
    if retry is not None and not isinstance(retry, Retry):
        raise ConfigurationError(f"{where}: retry must be a Retry or None, got {retry!r}")
    seconds = None if timeout is None else check_seconds(timeout, f"{where}: timeout")
    if offload is not None and offload not in _OFFLOADS:
        raise ConfigurationError(
            f"{where}: offload must be one of {', '.join(_OFFLOADS)} or None, got {offload!r}"
        )
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigurationError(f"{where}: group must be a non-empty string, got {group!r}")
    if batch is not None:
        _check_batch(batch, where, capacity, concurrency, admission)
    _check_ordering(where, ordering, key_failure, batch, partitions)
    if max_in_flight is not None:
        check_count(max_in_flight, f"{where}: max_in_flight", 1)
    if max_in_flight is not None and batch is not None:
        raise ConfigurationError(
            f"{where}: max_in_flight cannot be combined with batch= (a batch handler holds "
            "many envelopes in one call)"
        )
    return policy, seconds, check_middleware(middleware, where)


def _check_ordering(
    where: str, ordering: Any, key_failure: Any, batch: Batch | None, partitions: Any
) -> None:
    """Refuse an ordering this bus does not know, or one that cannot work on this stage."""
    if partitions is not None:
        check_count(partitions, f"{where}: partitions", 1, MAX_PARTITIONS)
        if ordering is None:
            raise ConfigurationError(
                f"{where}: partitions={partitions} needs ordering='key' (partitions split an "
                "ordered group's keys)"
            )
    if ordering is not None and ordering not in ORDERINGS:
        raise ConfigurationError(
            f"{where}: ordering must be None or {', '.join(map(repr, ORDERINGS))}, got {ordering!r}"
        )
    if key_failure not in KEY_FAILURES:
        raise ConfigurationError(
            f"{where}: key_failure must be one of {', '.join(map(repr, KEY_FAILURES))}, "
            f"got {key_failure!r}"
        )
    if ordering is None and key_failure != "continue":
        raise ConfigurationError(
            f"{where}: key_failure={key_failure!r} needs ordering='key' (only an ordered "
            "stage has envelopes waiting for their key)"
        )
    if ordering is not None and batch is not None:
        raise ConfigurationError(
            f"{where}: ordering={ordering!r} cannot be combined with batch= (a batch hands "
            "the handler many envelopes at once, whatever their keys)"
        )


def _check_batch(
    batch: Any,
    where: str,
    capacity: int,
    concurrency: int | Adaptive,
    admission: Admission | None,
) -> None:
    """Refuse a batch that is not a :class:`Batch` or that cannot work on this stage."""
    if not isinstance(batch, Batch):
        raise ConfigurationError(f"{where}: batch must be a Batch or None, got {batch!r}")
    # (Its own fields were checked when it was made; checked again in case it was not.)
    Batch.__post_init__(batch)
    if batch.max_size > capacity:
        raise ConfigurationError(
            f"{where}: batch max_size={batch.max_size} is larger than capacity={capacity}: "
            "a batch could never fill (raise capacity or lower max_size)"
        )
    if isinstance(concurrency, Adaptive) or admission is not None:
        raise ConfigurationError(
            f"{where}: batch= cannot be combined with "
            f"{'Adaptive concurrency' if isinstance(concurrency, Adaptive) else 'admission='}"
            " (a batch stage runs a fixed number of consumers; give concurrency an int)"
        )


def unwrap_partial(handler: Any) -> Any:
    """The function behind ``functools.partial`` layers."""
    while isinstance(handler, functools.partial):
        handler = handler.func
    return handler


def _is_async(handler: Any) -> bool:
    handler = unwrap_partial(handler)
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - callable objects with async __call__
    )


def _layers(handler: Any) -> Iterator[Any]:
    """``handler``, then what it wraps, down to the function whose body does the work.

    Through ``functools.partial``, ``staticmethod``/``classmethod`` objects, bound
    methods and ``functools.wraps`` wrappers (``__wrapped__``); it stops at a coroutine
    function (an async wrapper's own body decides what runs).
    """
    seen: set[int] = set()
    current = handler
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        if inspect.iscoroutinefunction(current):
            return
        if isinstance(current, functools.partial):
            current = current.func
        elif isinstance(current, staticmethod | classmethod) or inspect.ismethod(current):
            current = current.__func__
        else:
            try:
                current = inspect.getattr_static(current, "__wrapped__", None)
            except Exception:  # an object whose attribute lookup itself fails
                return


def _check_handler(handler: Any, where: str) -> None:
    """Refuse what cannot be a handler: a generator function, or a wrong signature.

    Calling a generator function only makes a generator; its body would never run,
    and the envelope would be acked for work that was not done. An async generator
    function is refused behind any plain wrapper too (a ``functools.wraps``
    decorator, a partial, a static or class method, a bound method).
    """
    for depth, layer in enumerate(_layers(handler)):
        call = getattr(layer, "__call__", None)  # noqa: B004 - an instance's own __call__
        for candidate in (layer, call):
            if inspect.isasyncgenfunction(candidate) or (
                depth == 0 and inspect.isgeneratorfunction(candidate)
            ):
                raise ConfigurationError(
                    f"{where}: {handler!r} is a generator function"
                    + (f" (it wraps {layer!r})" if layer is not handler else "")
                    + "; a handler must be a plain or async function (its body would "
                    "never run)"
                )
    if not callable(handler):
        raise ConfigurationError(f"{where}: handler must be callable, got {handler!r}")
    if isinstance(handler, staticmethod | classmethod):
        return  # (its function's signature is checked through the bus's call of it)
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):
        return  # a builtin or an extension callable: nothing to check
    try:
        signature.bind(None)
    except TypeError:
        raise ConfigurationError(
            f"{where}: handler {handler!r} must take one positional argument (the payload, "
            f"or the envelope when annotated Envelope); its signature is {signature}"
        ) from None


def check_middleware(middleware: Any, where: str) -> tuple[Middleware, ...]:
    """``middleware`` as a tuple of callables.

    :raises ConfigurationError: when it is not a sequence of callables (a single
        middleware given bare, say).
    """
    if callable(middleware) or not isinstance(middleware, Iterable):
        raise ConfigurationError(
            f"{where}: middleware must be a sequence of middleware, got {middleware!r}"
        )
    layers = tuple(middleware)
    for layer in layers:
        if not callable(layer):
            raise ConfigurationError(f"{where}: middleware {layer!r} is not callable")
    return layers
