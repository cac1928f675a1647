"""Contextvars a bus carries from the publisher to the handler, in memory.

``Bus(propagate_contextvars=[request_id, tenant])`` captures the values those
variables hold where an envelope is sent (a publish, a request, a slip hop: the
handler's context for a hop) and sets them in the handler's context while it handles
the envelope. The values ride beside the headers, never in them: no codec sees them,
so over a broker nothing is carried (the receiving process has its own context).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar, Token
from types import MappingProxyType
from typing import Any

from ._envelope import Envelope, replace_headers
from ._exceptions import ConfigurationError
from ._instrument import Consumer, Instrumentation, Result, SendKind

__all__ = [
    "CarryingHeaders",
    "ContextVarCarrier",
    "checked_contextvars",
    "set_headers",
    "with_headers",
]

_MISSING: Any = object()

Values = tuple[tuple[ContextVar[Any], Any], ...]


class CarryingHeaders(Mapping[str, str]):
    """Read-only headers that also carry contextvar values, in memory only.

    It is the envelope's headers mapping in every respect (equal to a dict of the same
    items); :attr:`carried` is not part of the mapping, so nothing serialises it.
    """

    __slots__ = ("_fields", "carried")

    def __init__(self, fields: dict[str, str], carried: Values) -> None:
        self._fields = fields
        #: ``(variable, value)`` pairs captured where the envelope was sent.
        self.carried = carried

    def __getitem__(self, name: str) -> str:
        return self._fields[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return repr(self._fields)

    def with_fields(self, fields: dict[str, str]) -> CarryingHeaders:
        """The same carried values with other header fields."""
        return CarryingHeaders(fields, self.carried)


class ContextVarCarrier(Instrumentation):
    """The instrumentation behind ``Bus(propagate_contextvars=...)``."""

    __slots__ = ("variables",)

    def __init__(self, variables: tuple[ContextVar[Any], ...]) -> None:
        self.variables = variables

    def send(self, kind: SendKind, envelope: Envelope, system: str) -> tuple[Envelope, object]:
        if kind == "replay":
            return envelope, None  # the same message again, with what it carried first
        values = tuple(
            (variable, value)
            for variable in self.variables
            if (value := variable.get(_MISSING)) is not _MISSING
        )
        headers = envelope.headers
        if values:
            carried = CarryingHeaders(dict(headers), values)
        elif isinstance(headers, CarryingHeaders):
            carried = CarryingHeaders(headers._fields, ())  # a hop: nothing set any more
        else:
            return envelope, None
        return replace_headers(envelope, carried), None

    def enter(self, consumer: Consumer, envelope: Envelope) -> object:
        headers = envelope.headers
        if not isinstance(headers, CarryingHeaders) or not headers.carried:
            return None
        return [variable.set(value) for variable, value in headers.carried]

    def exit(self, token: object, result: Result) -> None:
        if token is None:
            return
        tokens: list[Token[Any]] = token  # type: ignore[assignment]
        for each in reversed(tokens):
            each.var.reset(each)


def checked_contextvars(variables: Sequence[ContextVar[Any]]) -> tuple[ContextVar[Any], ...]:
    """``variables`` as a tuple, each a :class:`contextvars.ContextVar`.

    :raises ConfigurationError: for anything else (a name, a string of names).
    """
    if isinstance(variables, str | bytes):
        raise ConfigurationError(
            f"Bus: propagate_contextvars takes ContextVar objects, not names, got {variables!r}"
        )
    checked = tuple(variables)
    for variable in checked:
        if not isinstance(variable, ContextVar):
            raise ConfigurationError(
                f"Bus: propagate_contextvars takes contextvars.ContextVar objects, got {variable!r}"
            )
    return checked


def with_headers(envelope: Envelope, extra: Mapping[str, str]) -> Envelope:
    """A copy of ``envelope`` whose headers also hold ``extra`` (replacing same names)."""
    return set_headers(envelope, {**envelope.headers, **extra})


def set_headers(envelope: Envelope, fields: dict[str, str]) -> Envelope:
    """A copy of ``envelope`` whose headers are ``fields`` (taken over, not copied).

    Values a bus carries in memory beside the headers (contextvars) are kept.
    """
    headers = envelope.headers
    if isinstance(headers, CarryingHeaders):
        return replace_headers(envelope, headers.with_fields(fields))
    return replace_headers(envelope, MappingProxyType(fields))
