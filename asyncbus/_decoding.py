"""Typed payloads: decode a payload into the dataclass, msgspec Struct or pydantic model
a handler's parameter is annotated with."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ._exceptions import DecodeError

__all__ = ["payload_decoder"]

Decoder = Callable[[Any], Any]


def _is_msgspec_struct(annotation: type) -> bool:
    msgspec = sys.modules.get("msgspec")
    return msgspec is not None and issubclass(annotation, msgspec.Struct)


def _is_pydantic_model(annotation: type) -> bool:
    pydantic = sys.modules.get("pydantic")
    return pydantic is not None and issubclass(annotation, pydantic.BaseModel)


def payload_decoder(annotation: object) -> Decoder | None:
    """Return a function decoding a payload into ``annotation``, or ``None`` if not typed.

    Dataclasses and msgspec Structs are converted with ``msgspec.convert`` when msgspec
    is installed (validating field types), dataclasses otherwise with ``cls(**payload)``;
    pydantic models with ``model_validate``. A payload that is already an instance
    passes through. Every mismatch raises :class:`DecodeError` naming the type.
    """
    if not isinstance(annotation, type):
        return None
    cls = annotation
    if _is_pydantic_model(cls):

        def decode_pydantic(payload: Any) -> Any:
            if isinstance(payload, cls):
                return payload
            try:
                return cls.model_validate(payload)  # type: ignore[attr-defined]
            except Exception as error:
                raise DecodeError(f"payload does not fit {cls.__qualname__}: {error}") from error

        return decode_pydantic
    if not (dataclasses.is_dataclass(cls) or _is_msgspec_struct(cls)):
        return None
    try:
        import msgspec
    except ImportError:
        msgspec = None  # type: ignore[assignment]

    def decode(payload: Any) -> Any:
        if isinstance(payload, cls):
            return payload
        try:
            if msgspec is not None:
                return msgspec.convert(payload, cls)
            if not isinstance(payload, Mapping):
                raise TypeError(f"expected a mapping, got {type(payload).__name__}")
            return cls(**payload)
        except Exception as error:
            raise DecodeError(f"payload does not fit {cls.__qualname__}: {error}") from error

    return decode
