"""A subscription's configuration, and how its handler becomes a stage's chain."""

from __future__ import annotations

import functools
import inspect
import itertools
import pickle
import typing
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_process

from ._adaptive import Adaptive
from ._admission import Admission
from ._checks import check_seconds
from ._decoding import payload_decoder
from ._dispatch import handler_failure
from ._envelope import Envelope
from ._exceptions import ConfigurationError, Reject
from ._offload import WorkerPool, run_niced
from ._routing import compile_pattern
from ._stage import Backpressure

if TYPE_CHECKING:
    from ._types import Handler, Middleware
    from .middleware.retry import Retry

__all__ = ["Offload", "Subscription", "build_chain", "check_middleware", "default_group"]

Offload = Literal["thread", "process", "inline"]
_OFFLOADS = ("thread", "process", "inline")
_unique = itertools.count(1)
#: Built-ins that act only on envelopes with a slip, a reply address or a ttl.
_PASS_THROUGH = frozenset({"routing_slip", "expire"})


@dataclass(frozen=True, slots=True, eq=False)
class Subscription:
    """One handler registered on a topic pattern; returned by ``bus.subscribe(topic, handler)``.

    :ivar stage: the name of the stage it belongs to, ``"pattern@group"``.
    """

    topic: str
    handler: Callable[..., Any]
    group: str
    concurrency: int | Adaptive
    capacity: int
    backpressure: Backpressure
    retry: Retry | None
    timeout: float | None
    offload: Offload | None
    middleware: tuple[Middleware, ...]
    #: Sojourn shedding of the stage, ``None`` for none.
    admission: Admission | None = None

    @property
    def stage(self) -> str:
        """Name of the stage this subscription feeds: ``"pattern@group"``."""
        return f"{self.topic}@{self.group}"


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
) -> Subscription:
    """Validate everything ``subscribe`` was given and return the :class:`Subscription`.

    :raises ConfigurationError: naming the argument that cannot work.
    """
    from .middleware.retry import Retry

    compile_pattern(topic)
    where = f"subscribe({topic!r})"
    if not callable(handler):
        raise ConfigurationError(f"{where}: handler must be callable, got {handler!r}")
    _check_handler(handler, where)
    for name, value in (("concurrency", concurrency), ("capacity", capacity)):
        if name == "concurrency" and isinstance(value, Adaptive):
            continue  # validated when it was made
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
    is_async = _is_async(handler)
    if is_async and offload in ("thread", "process"):
        raise ConfigurationError(f"{where}: offload={offload!r} needs a sync handler")
    if group is not None and (not isinstance(group, str) or not group):
        raise ConfigurationError(f"{where}: group must be a non-empty string, got {group!r}")
    layers = check_middleware(middleware, where)
    return Subscription(
        topic=topic,
        handler=handler,
        group=group if group is not None else default_group(handler),
        concurrency=concurrency,
        capacity=capacity,
        backpressure=policy,
        retry=retry,
        timeout=seconds,
        offload=None if is_async else typing.cast("Offload", offload or "thread"),
        middleware=layers,
        admission=admission,
    )


def _unwrap(handler: Any) -> Any:
    while isinstance(handler, functools.partial):
        handler = handler.func
    return handler


def _is_async(handler: Any) -> bool:
    handler = _unwrap(handler)
    return inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(
        getattr(handler, "__call__", None)  # noqa: B004 - callable objects with async __call__
    )


def _check_handler(handler: Any, where: str) -> None:
    """Refuse what cannot be a handler: a generator function, or a wrong signature.

    Calling a generator function only makes a generator; its body would never run,
    and the envelope would be acked for work that was not done.
    """
    function = _unwrap(handler)
    call = getattr(function, "__call__", None)  # noqa: B004 - an instance's own __call__
    for candidate in (function, call):
        if inspect.isasyncgenfunction(candidate) or inspect.isgeneratorfunction(candidate):
            raise ConfigurationError(
                f"{where}: {handler!r} is a generator function; a handler must be a "
                "plain or async function (its body would never run)"
            )
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


def first_parameter_type(handler: Any) -> object:
    """The resolved annotation of the handler's first parameter (``None`` when absent)."""
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
        except Exception:
            return Envelope if written.rpartition(".")[2] == "Envelope" else None
    return annotation


def argument_of(handler: Any) -> Callable[[Envelope], Any] | None:
    """How to get the handler's argument from an envelope; ``None`` means the raw payload."""
    annotation = first_parameter_type(handler)
    if annotation is Envelope:
        return _identity
    decoder = payload_decoder(annotation)
    if decoder is None:
        return None
    return lambda envelope: decoder(envelope.payload)


def _identity(envelope: Envelope) -> Envelope:
    return envelope


def _payload(envelope: Envelope) -> Any:
    return envelope.payload


def adapt_handler(subscription: Subscription, pool: WorkerPool) -> Handler:
    """Turn the user's function into a :data:`Handler` (the innermost, offloading layer).

    The handler gets the envelope when its first parameter is annotated
    :class:`Envelope`, the payload decoded when annotated with a dataclass, msgspec
    Struct or pydantic model (:class:`DecodeError` otherwise), else the raw payload.
    A sync function that returns an awaitable (an async function behind a plain
    wrapper) has it awaited on the loop: its work runs before the envelope is acked.
    """
    function = subscription.handler
    argument = argument_of(function)
    if subscription.offload is None:
        if argument is _identity:
            return typing.cast("Handler", function)
        if argument is None:

            def call_async(env: Envelope) -> Any:
                return function(env.payload)

            call_async.payload_function = function  # type: ignore[attr-defined]
            return call_async

        def call_async_typed(env: Envelope) -> Any:
            return function(argument(env))

        return call_async_typed
    extract = argument or _payload
    if subscription.offload == "inline":

        async def call_inline(env: Envelope) -> Any:
            return await _settled(function(extract(env)))

        return call_inline
    if subscription.offload == "process":

        async def call_in_process(env: Envelope) -> Any:
            value = extract(env)
            try:
                pickle.dumps((function, value))
            except Exception as error:  # pickle raises anything a __reduce__ raises
                raise Reject(
                    f"offload='process' needs a picklable handler and payload; pickling "
                    f"failed: {type(error).__name__}: {error}"
                ) from error
            return await anyio.to_process.run_sync(
                run_niced, function, value, cancellable=True, limiter=pool.limiter
            )

        return call_in_process

    async def call_in_thread(env: Envelope) -> Any:
        return await _settled(await pool.run(function, extract(env), env))

    return call_in_thread


async def _settled(result: Any) -> Any:
    """``result``, awaited first when a sync handler returned an awaitable."""
    if inspect.isawaitable(result):
        return await result
    return result


def build_chain(
    subscription: Subscription, handler: Handler, bus_middleware: Sequence[Middleware]
) -> Handler:
    """Wrap ``handler`` in the stage's middleware, first listed outermost.

    Default order: ``dead_letter ▸ routing_slip ▸ expire ▸ retry ▸ timeout ▸ bus
    middleware ▸ subscription middleware ▸ handler``. A built-in the user lists
    replaces the default of its kind, at the place the user put it.
    """
    from .middleware import dead_letter, expire, routing_slip
    from .middleware.timeout import timeout as timeout_middleware

    user = [*bus_middleware, *subscription.middleware]
    listed = {getattr(layer, "asyncbus_builtin", None) for layer in user}
    defaults: list[Middleware] = [dead_letter(), routing_slip(), expire()]
    if subscription.retry is not None:
        defaults.append(subscription.retry)
    if subscription.timeout is not None:
        defaults.append(timeout_middleware(subscription.timeout))
    layers = [layer for layer in defaults if getattr(layer, "asyncbus_builtin", None) not in listed]
    layers += user
    if layers and getattr(layers[0], "asyncbus_builtin", None) == "dead_letter":
        # Outermost, the dead-letter layer would catch exactly what the consumer
        # catches and do the same with it (Dispatch.fail): skip the extra frame.
        layers = layers[1:]
    if not {getattr(layer, "asyncbus_builtin", None) for layer in layers} <= _PASS_THROUGH:
        # Retry, timeouts and the user's middleware see a stray cancellation as the
        # failure it is (the consumer does the same for the fused chain below).
        chain = _failing_on_stray_cancellation(handler)
        for layer in reversed(layers):
            chain = layer(chain)
        return chain
    chain = handler
    for layer in reversed(layers):
        chain = layer(chain)
    # Only layers that do nothing for a plain envelope: test that once and call the
    # handler directly, instead of passing through each layer in turn.
    general = chain
    on_payload = getattr(handler, "payload_function", None)
    if on_payload is not None:  # an async handler of the payload: call it directly

        def fused_payload(envelope: Envelope) -> Awaitable[Any]:
            if envelope.slip or envelope.reply_to is not None or envelope.ttl is not None:
                return general(envelope)
            return on_payload(envelope.payload)  # type: ignore[no-any-return]

        return fused_payload

    def fused(envelope: Envelope) -> Awaitable[Any]:
        if envelope.slip or envelope.reply_to is not None or envelope.ttl is not None:
            return general(envelope)
        return handler(envelope)

    return fused


def _failing_on_stray_cancellation(handler: Handler) -> Handler:
    """``handler``, raising :class:`HandlerCancelled` for a cancellation that is not ours."""

    async def guarded(envelope: Envelope) -> Any:
        try:
            return await handler(envelope)
        except BaseException as error:  # deliberate: only a stray cancellation is changed
            failure = handler_failure(error)
            if failure is None or failure is error:
                raise
            raise failure from error

    return guarded
