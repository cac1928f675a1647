"""Arbitrary payloads as JSON-safe data, for showing them to a person."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import itertools
import math
import reprlib
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["json_safe"]

_MAX_STRING = 4096
_MAX_ITEMS = 200
_MAX_NODES = 5000
_MAX_DEPTH = 32
_repr = reprlib.Repr()
_repr.maxstring = _MAX_STRING
_repr.maxother = _MAX_STRING
_repr.maxlevel = 4


def json_safe(value: object) -> Any:
    """Return ``value`` as data that ``json.dumps(..., allow_nan=False)`` accepts.

    Payloads are user objects: dataclasses, ``msgspec.Struct`` and pydantic models
    become objects, containers lists and objects, non-finite floats strings; anything
    else, too deep or too big becomes a clipped ``repr``, so one odd payload never
    breaks the page that shows it. Long strings and containers are clipped, with a
    note of how much was left out.
    """
    return _Converter().convert(value, 0)


class _Converter:
    """One conversion, within a budget of nodes (cycles and huge payloads end in it)."""

    def __init__(self) -> None:
        self.budget = _MAX_NODES

    def convert(self, value: object, depth: int) -> Any:
        self.budget -= 1
        if value is None or isinstance(value, bool | int):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else repr(value)
        if isinstance(value, str):
            return _clip(value)
        if self.budget <= 0:
            return "…"
        if depth > _MAX_DEPTH:
            return _safe_repr(value)
        try:
            return self._convert(value, depth)
        except Exception:  # a broken __len__, __iter__ or property: show what it is
            return _safe_repr(value)

    def _convert(self, value: object, depth: int) -> Any:
        if isinstance(value, enum.Enum):
            return self.convert(value.value, depth + 1)
        if isinstance(value, bytes | bytearray | memoryview):
            data = bytes(value[:64])
            more = len(value) - len(data)
            return repr(data) + (f"… ({more} more bytes)" if more else "")
        if isinstance(value, datetime.date | datetime.time):
            return value.isoformat()
        if isinstance(value, uuid.UUID | decimal.Decimal):
            return str(value)
        if isinstance(value, Mapping):
            return self._mapping(value.items(), len(value), depth)
        if isinstance(value, list | tuple | set | frozenset):
            converted = [
                self.convert(item, depth + 1) for item in itertools.islice(value, _MAX_ITEMS)
            ]
            if len(value) > _MAX_ITEMS:
                converted.append(f"… ({len(value) - _MAX_ITEMS} more)")
            return converted
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            names = [field.name for field in dataclasses.fields(value)]
            return self._attributes(value, names, depth)
        struct_fields = getattr(type(value), "__struct_fields__", None)  # msgspec.Struct
        if isinstance(struct_fields, tuple):
            return self._attributes(value, struct_fields, depth)
        model_dump = getattr(value, "model_dump", None)  # pydantic v2
        if callable(model_dump) and not isinstance(value, type):
            return self.convert(model_dump(mode="json"), depth + 1)
        return _safe_repr(value)

    def _attributes(self, value: object, names: Iterable[str], depth: int) -> dict[str, Any]:
        names = list(names)
        return self._mapping(((n, getattr(value, n, None)) for n in names), len(names), depth)

    def _mapping(self, items: Iterable[tuple[Any, Any]], size: int, depth: int) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, item in itertools.islice(items, _MAX_ITEMS):
            name = key if isinstance(key, str) else _safe_repr(key)
            result[_clip(name)] = self.convert(item, depth + 1)
        if size > _MAX_ITEMS:
            result["…"] = f"{size - _MAX_ITEMS} more"
        return result


def _clip(text: str) -> str:
    if len(text) <= _MAX_STRING:
        return text
    return f"{text[:_MAX_STRING]}… ({len(text) - _MAX_STRING} more characters)"


def _safe_repr(value: object) -> str:
    try:
        return _repr.repr(value)
    except Exception:
        return f"<unrepresentable {type(value).__qualname__}>"
