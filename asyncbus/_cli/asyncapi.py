"""``python -m asyncbus asyncapi module:bus``: print the bus's AsyncAPI 3.0 document."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._bus import Bus
from .._exceptions import ConfigurationError
from ..asyncapi import document
from . import Command, CommandError
from .target import import_object, kind_of

__all__ = ["COMMAND"]


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Print the AsyncAPI 3.0 document of the bus that module:bus names (or that the "
        "function it names returns): channels, operations, message schemas and servers."
    )
    parser.add_argument("target", metavar="module:bus", help="where the bus is, e.g. myapp:bus")
    parser.add_argument("--title", help="the document's title (default: the bus's name)")
    parser.add_argument(
        "--version",
        dest="document_version",
        metavar="VERSION",
        default="0.1.0",
        help="the application's version (default: %(default)s)",
    )
    parser.add_argument(
        "--publications",
        metavar="module:mapping",
        help="a mapping of the topics the application publishes to their payload types",
    )
    parser.add_argument(
        "--format", choices=("json", "yaml"), default="json", help="yaml needs PyYAML"
    )
    parser.add_argument("--output", "-o", metavar="FILE", help="write to FILE, not stdout")


def _load_bus(spec: str) -> Bus:
    """The bus ``spec`` names, or the one the function it names returns."""
    found = import_object(spec)
    if not isinstance(found, Bus) and callable(found):
        try:
            factory = kind_of(found, spec) == "factory"
        except CommandError:
            factory = False
        if factory:
            found = found()
    if not isinstance(found, Bus):
        raise CommandError(f"{spec!r} is a {type(found).__qualname__}, not an asyncbus Bus")
    return found


def _run(arguments: argparse.Namespace, rest: list[str]) -> int:
    """Print (or write) the document; 2 with a message on stderr when it cannot."""
    dump: Callable[[dict[str, Any]], str] = _json
    if arguments.format == "yaml":
        try:
            dump = _yaml()
        except ImportError:
            return _fail("--format yaml needs PyYAML: pip install pyyaml")
    try:
        bus = _load_bus(arguments.target)
        publications = None
        if arguments.publications is not None:
            found = import_object(arguments.publications)
            if not isinstance(found, Mapping):
                raise CommandError(
                    f"{arguments.publications!r} is a {type(found).__qualname__}, "
                    "not a mapping of topics to payload types"
                )
            publications = found
        spec = document(
            bus,
            title=arguments.title,
            version=arguments.document_version,
            publications=publications,
        )
    except (CommandError, ConfigurationError) as error:
        return _fail(str(error))
    text = dump(spec)
    if arguments.output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(arguments.output).write_text(text, encoding="utf-8")
    except OSError as error:
        return _fail(f"cannot write {arguments.output}: {error}")
    return 0


def _json(spec: dict[str, Any]) -> str:
    return json.dumps(spec, indent=2, ensure_ascii=False) + "\n"


def _yaml() -> Callable[[dict[str, Any]], str]:
    """PyYAML's ``safe_dump``, keys in the document's order.

    :raises ImportError: without PyYAML.
    """
    import yaml  # type: ignore[import-untyped]

    class Dumper(yaml.SafeDumper):  # type: ignore[misc]
        def ignore_aliases(self, data: Any) -> bool:
            return True  # the same schema twice is written twice, not as an anchor

    def dump(spec: dict[str, Any]) -> str:
        text: str = yaml.dump(spec, Dumper=Dumper, sort_keys=False, allow_unicode=True)
        return text

    return dump


def _fail(message: str) -> int:
    print(f"python -m asyncbus asyncapi: {message}", file=sys.stderr)
    return 2


#: ``python -m asyncbus asyncapi``.
COMMAND = Command(
    help="print the AsyncAPI 3.0 document of a bus, given as module:bus",
    configure=_configure,
    run=_run,
)
