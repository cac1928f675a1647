"""JSON Schema of Python type annotations, for the AsyncAPI document of a bus.

The standard library's types (scalars, containers, unions, literals, enums,
dataclasses, TypedDicts) are described here, the same with or without extras
installed; a msgspec ``Struct`` is described by msgspec and a pydantic model by
pydantic. Named types become entries of one ``components/schemas`` table that the
schemas refer to (``$ref``), so a type used by several messages is written once, and
two types with one name get two entries. The dialect is AsyncAPI's (JSON Schema
draft-07): what the libraries write in later drafts is translated.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import inspect
import math
import re
import sys
import types
import typing
import uuid
from collections import abc, deque
from collections.abc import Callable
from typing import Any

__all__ = ["REF", "Schema", "Schemas", "safe_name"]

Schema = dict[str, Any]

#: Where a ``$ref`` points: the document's ``components/schemas``.
REF = "#/components/schemas/"
#: The references msgspec and pydantic are told to write, rewritten on adoption.
_FOREIGN = "asyncbus-foreign:"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]+")

_SCALARS: dict[object, Schema] = {
    type(None): {"type": "null"},
    bool: {"type": "boolean"},
    int: {"type": "integer"},
    float: {"type": "number"},
    str: {"type": "string"},
    bytes: {"type": "string", "contentEncoding": "base64"},
    bytearray: {"type": "string", "contentEncoding": "base64"},
    datetime.datetime: {"type": "string", "format": "date-time"},
    datetime.date: {"type": "string", "format": "date"},
    datetime.time: {"type": "string", "format": "time"},
    datetime.timedelta: {"type": "string", "format": "duration"},
    uuid.UUID: {"type": "string", "format": "uuid"},
    decimal.Decimal: {"type": "string", "format": "decimal"},
}
_ARRAYS = frozenset(
    {list, tuple, set, frozenset, deque, abc.Sequence, abc.MutableSequence, abc.Set}
    | {abc.MutableSet, abc.Collection, abc.Iterable}
)
_UNIQUE = frozenset({set, frozenset, abc.Set, abc.MutableSet})
_OBJECTS = frozenset({dict, abc.Mapping, abc.MutableMapping})
#: What only qualifies the type it holds.
_WRAPPERS = frozenset({typing.Annotated, typing.Required, typing.NotRequired})


def safe_name(text: str) -> str:
    """``text`` with every run of characters a component name cannot hold made ``_``."""
    return _UNSAFE.sub("_", text).strip("_") or "_"


class Schemas:
    """The schemas of one document: :meth:`of` an annotation, :attr:`components` of all."""

    def __init__(self) -> None:
        #: Component name -> schema, for ``components/schemas``.
        self.components: dict[str, Schema] = {}
        self._names: dict[object, str] = {}

    def of(self, annotation: object) -> Schema:
        """The schema of values of type ``annotation`` (``{}``: anything)."""
        annotation = _bare(annotation)
        if annotation is Any or annotation is object or isinstance(annotation, typing.TypeVar):
            return {}
        scalar = _scalar(annotation)
        if scalar is not None:
            return scalar
        origin = typing.get_origin(annotation)
        arguments = typing.get_args(annotation)
        if origin is typing.Literal:
            return _literal(arguments)
        if origin is typing.Union or origin is types.UnionType:
            return {"anyOf": [self.of(argument) for argument in arguments]}
        if origin in _ARRAYS or annotation in _ARRAYS:
            return self._array(origin or annotation, arguments)
        if origin in _OBJECTS or annotation in _OBJECTS:
            values = self.of(arguments[1]) if len(arguments) == 2 else {}
            schema: Schema = {"type": "object"}
            if values:
                schema["additionalProperties"] = values
            return schema
        if not isinstance(annotation, type):
            return {}
        if issubclass(annotation, enum.Enum):
            return _enumeration(annotation)
        if _module_class(annotation, "msgspec", "Struct"):
            return self._foreign(annotation, _msgspec_schema)
        if _module_class(annotation, "pydantic", "BaseModel"):
            return self._foreign(annotation, _pydantic_schema)
        if dataclasses.is_dataclass(annotation) or typing.is_typeddict(annotation):
            return self._named(annotation)
        for base in annotation.__mro__[1:]:  # a subclass of a builtin: described as its base
            if base in _SCALARS or base in _ARRAYS or base in _OBJECTS:
                return self.of(base)
        return {}

    def add(self, name: str, schema: Schema) -> Schema:
        """Put ``schema`` in the components under ``name`` (or a free variant); its ``$ref``."""
        claimed = self._claim(name)
        self.components[claimed] = schema
        return {"$ref": REF + claimed}

    # -- named types ----------------------------------------------------------

    def _claim(self, name: str, qualified: str | None = None) -> str:
        """A component name not taken yet: ``name``, else ``qualified``, else numbered."""
        for candidate in (name, qualified):
            if candidate is not None and safe_name(candidate) not in self.components:
                return safe_name(candidate)
        base = safe_name(qualified or name)
        number = 2
        while f"{base}-{number}" in self.components:
            number += 1
        return f"{base}-{number}"

    def _named(self, cls: type) -> Schema:
        name = self._names.get(cls)
        if name is None:
            name = self._claim(cls.__name__, f"{cls.__module__}.{cls.__qualname__}")
            self._names[cls] = name
            self.components[name] = {}  # taken now: a field of its own type refers to it
            self.components[name] = self._object(cls)
        return {"$ref": REF + name}

    def _object(self, cls: type) -> Schema:
        try:
            hints = typing.get_type_hints(cls, include_extras=True)
        except Exception:  # an annotation naming what is not importable here
            hints = {}
        fields: list[tuple[str, object, bool, object]] = []
        if dataclasses.is_dataclass(cls):
            for field in dataclasses.fields(cls):
                if field.init:
                    missing = field.default is dataclasses.MISSING
                    required = missing and field.default_factory is dataclasses.MISSING
                    annotation = hints.get(field.name, Any)
                    fields.append((field.name, annotation, required, field.default))
        else:
            for key, annotation in hints.items():
                required = _required_key(cls, key, annotation)
                fields.append((key, annotation, required, dataclasses.MISSING))
        properties: dict[str, Schema] = {}
        for name, annotation, _, default in fields:
            properties[name] = self.of(annotation)
            if _json_scalar(default) and not properties[name].get("$ref"):
                properties[name]["default"] = default
        schema: Schema = {"type": "object", "title": cls.__name__, "properties": properties}
        names = [name for name, _, needed, _ in fields if needed]
        if names:
            schema["required"] = names
        description = _own_doc(cls)
        if description:
            schema["description"] = description
        return schema

    def _array(self, origin: object, arguments: tuple[Any, ...]) -> Schema:
        schema: Schema = {"type": "array"}
        if origin is tuple and arguments and arguments[-1] is not Ellipsis:
            if arguments == ((),):  # tuple[()]
                arguments = ()
            schema["items"] = [self.of(argument) for argument in arguments]
            schema["minItems"] = schema["maxItems"] = len(arguments)
        elif arguments:
            items = self.of(arguments[0])
            if items:
                schema["items"] = items
        if origin in _UNIQUE:
            schema["uniqueItems"] = True
        return schema

    # -- schemas written by msgspec and pydantic --------------------------------

    def _foreign(
        self, cls: type, generate: Callable[[type], tuple[Schema, dict[str, Schema]]]
    ) -> Schema:
        known = self._names.get(cls)
        if known is not None:
            return {"$ref": REF + known}
        try:
            top, definitions = generate(cls)
        except Exception as error:  # a field type the library cannot describe
            return {"description": f"no schema for {cls.__qualname__}: {type(error).__name__}"}
        names = self._adopt(definitions)
        schema: Schema = _translate(top, names)
        reference = schema.get("$ref")
        if isinstance(reference, str) and reference.startswith(REF) and len(schema) == 1:
            self._names[cls] = reference[len(REF) :]
        return schema

    def _adopt(self, definitions: dict[str, Schema]) -> dict[str, str]:
        """Add ``definitions`` to the components; their names there, by their own names.

        A definition equal to a component of the same name (the same type, described
        twice) is that component; another one gets a name of its own. Equality is
        judged after the renames, so a definition that refers to a renamed one is not
        taken for the component it would otherwise equal.
        """
        names: dict[str, str] = {}
        taken = set(self.components)
        for name in definitions:
            candidate = safe_name(name)
            if candidate in names.values():  # two names made alike by safe_name
                candidate = self._free(candidate, taken | set(names.values()))
            names[name] = candidate
        while True:
            translated = {name: _translate(schema, names) for name, schema in definitions.items()}
            clashes = [
                name
                for name, schema in translated.items()
                if self.components.get(names[name], schema) != schema
            ]
            if not clashes:
                break
            for name in clashes:
                names[name] = self._free(names[name], taken | set(names.values()))
        for name, schema in translated.items():
            self.components[names[name]] = schema
        return names

    @staticmethod
    def _free(name: str, taken: set[str]) -> str:
        number = 2
        while f"{name}-{number}" in taken:
            number += 1
        return f"{name}-{number}"


def _bare(annotation: object) -> object:
    """``annotation`` without ``Annotated``, ``NewType`` and ``type X = ...`` wrappers."""
    for _ in range(32):
        if typing.get_origin(annotation) in _WRAPPERS:
            annotation = typing.get_args(annotation)[0]
        elif isinstance(annotation, typing.NewType):
            annotation = annotation.__supertype__
        elif type(annotation).__name__ == "TypeAliasType":  # Python 3.12's `type X = ...`
            annotation = getattr(annotation, "__value__", Any)
        else:
            break
    return annotation


def _required_key(cls: type, key: str, annotation: object) -> bool:
    """Whether the TypedDict ``cls`` requires ``key``, annotated ``annotation``.

    ``Required[...]`` and ``NotRequired[...]`` are read from the annotation itself:
    Python before 3.14 misses them when annotations are strings (``from __future__
    import annotations``), and counts such a key as the class's totality says.
    """
    origin = typing.get_origin(annotation)
    if origin is typing.NotRequired:
        return False
    if origin is typing.Required:
        return True
    return key in getattr(cls, "__required_keys__", frozenset())


def _scalar(annotation: object) -> Schema | None:
    if annotation is None:
        return {"type": "null"}
    try:
        found = _SCALARS.get(annotation)
    except TypeError:  # unhashable
        return None
    return dict(found) if found is not None else None


def _literal(values: tuple[Any, ...]) -> Schema:
    plain = [value.value if isinstance(value, enum.Enum) else value for value in values]
    if not all(_json_scalar(value) for value in plain):
        return {}
    schema: Schema = {"enum": plain}
    kinds = {_json_type(value) for value in plain}
    if len(kinds) == 1:
        schema["type"] = kinds.pop()
    return schema


def _enumeration(cls: type[enum.Enum]) -> Schema:
    schema = _literal(tuple(cls))
    schema["title"] = cls.__name__
    description = _own_doc(cls)
    if description and description != "An enumeration.":
        schema["description"] = description
    return schema


def _json_scalar(value: object) -> bool:
    """Whether ``value`` is a string, a finite number, a boolean or None."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str | int | bool | type(None))


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return "number" if isinstance(value, float) else "string"


def _own_doc(cls: type) -> str | None:
    """The class's own docstring, not one generated for it (dataclasses write one)."""
    doc = cls.__dict__.get("__doc__")
    if not isinstance(doc, str) or doc.startswith(f"{cls.__name__}("):
        return None
    return inspect.cleandoc(doc) or None


def _module_class(cls: type, module: str, name: str) -> bool:
    """Whether ``cls`` derives from ``module.name`` (never importing the module)."""
    loaded = sys.modules.get(module)
    base = getattr(loaded, name, None)
    return isinstance(base, type) and issubclass(cls, base)


def _msgspec_schema(cls: type) -> tuple[Schema, dict[str, Schema]]:
    msgspec = sys.modules["msgspec"]
    (top,), definitions = msgspec.json.schema_components([cls], ref_template=_FOREIGN + "{name}")
    return dict(top), dict(definitions)


def _pydantic_schema(cls: type) -> tuple[Schema, dict[str, Schema]]:
    schema: Schema = cls.model_json_schema(ref_template=_FOREIGN + "{model}")  # type: ignore[attr-defined]
    definitions: dict[str, Schema] = schema.pop("$defs", {})
    if "$ref" in schema:  # a recursive model: described among its definitions
        return schema, definitions
    name = cls.__name__
    while name in definitions:
        name += "_"
    definitions[name] = schema
    return {"$ref": _FOREIGN + name}, definitions


def _translate(schema: Any, names: dict[str, str]) -> Any:
    """``schema`` with references into the components, in draft-07 terms.

    ``discriminator`` objects (OpenAPI's) become the property name AsyncAPI expects,
    and ``prefixItems`` (2020-12) the list form of ``items``.
    """
    if isinstance(schema, list):
        return [_translate(item, names) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: _translate(value, names) for key, value in schema.items()}
    reference = result.get("$ref")
    if isinstance(reference, str) and reference.startswith(_FOREIGN):
        name = reference[len(_FOREIGN) :]
        result["$ref"] = REF + names.get(name, safe_name(name))
    discriminator = result.get("discriminator")
    if isinstance(discriminator, dict):
        result["discriminator"] = discriminator.get("propertyName", "")
    if "prefixItems" in result:
        rest = result.pop("items", None)
        result["items"] = result.pop("prefixItems")
        if rest is not None:
            result["additionalItems"] = rest
    return result
