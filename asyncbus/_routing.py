"""Topic patterns in NATS syntax and the table that routes a topic to its stages."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from ._exceptions import ConfigurationError

__all__ = ["PATTERN_SYNTAX", "Router", "compile_pattern", "validate_topic"]

T = TypeVar("T")

_ROUTE_CACHE_LIMIT = 8192


#: What no topic or pattern may hold: whitespace and control characters. NATS cannot
#: carry them in a subject, and a pattern holding one could match nothing a broker
#: carries (``"orders created"``).
_INVALID = re.compile(r"[\s\x00-\x1f\x7f]")

#: The pattern syntax, as every refusal of a pattern states it.
PATTERN_SYNTAX = (
    "patterns use NATS syntax: tokens split on '.', '*' matches one token, '>' the rest "
    "(last token only), as in 'orders.*' or 'orders.>'"
)


def _invalid_character(text: str) -> str | None:
    """What is wrong with ``text``'s characters, or ``None``."""
    found = _INVALID.search(text)
    if found is None:
        return None
    character = found.group()
    kind = "whitespace" if character.isspace() else "a control character"
    return f"holds {kind} ({character!r} at index {found.start()})"


def validate_topic(topic: str) -> None:
    """Raise :class:`ConfigurationError` unless ``topic`` is a concrete topic name.

    A topic is tokens split on ``.``, each a non-empty name; no token is a wildcard
    (``*``, ``>``) and no character is whitespace or a control character.
    """
    if not isinstance(topic, str) or not topic:
        raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
    tokens = topic.split(".")
    for token in tokens:
        if not token or token in ("*", ">"):
            raise ConfigurationError(
                f"topic {topic!r} is not publishable: every token must be a non-empty name "
                "(wildcards '*' and '>' belong in subscription patterns)"
            )
    problem = _invalid_character(topic)
    if problem is not None:
        raise ConfigurationError(
            f"topic {topic!r} {problem}: a topic is names split on '.', without whitespace "
            "or control characters"
        )


def compile_pattern(pattern: str) -> Callable[[str], bool]:
    """Return a predicate telling whether a topic matches ``pattern``.

    Tokens split on ``.``; ``*`` matches exactly one token, ``>`` (last token only)
    matches one or more remaining tokens.

    :raises ConfigurationError: for a pattern that could never match what is
        published: empty, an empty token, ``>`` before the end, a wildcard mixed into a
        token such as ``a*``, AMQP's ``#`` as a token, whitespace or a control
        character; the message states the syntax.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ConfigurationError(
            f"pattern must be a non-empty string, got {pattern!r}: {PATTERN_SYNTAX}"
        )
    tokens = pattern.split(".")
    for index, token in enumerate(tokens):
        problem = None
        if not token:
            problem = f"has an empty token at position {index}"
        elif token == ">" and index != len(tokens) - 1:
            problem = "'>' may only be the last token"
        elif token == "#":
            last = len(tokens) - 1
            meant = ".".join(
                (">" if at == last else "*") if name == "#" else name
                for at, name in enumerate(tokens)
            )
            problem = f"'#' is no wildcard here (AMQP's): write {meant!r}"
        elif token not in ("*", ">") and ("*" in token or ">" in token):
            problem = f"token {token!r} mixes a wildcard with a name"
        if problem is not None:
            raise ConfigurationError(f"pattern {pattern!r}: {problem}; {PATTERN_SYNTAX}")
    problem = _invalid_character(pattern)
    if problem is not None:
        raise ConfigurationError(f"pattern {pattern!r} {problem}; {PATTERN_SYNTAX}")
    if "*" not in tokens and ">" not in tokens:
        return pattern.__eq__
    tail = tokens[-1] == ">"
    fixed = tokens[:-1] if tail else tokens
    width = len(fixed)

    def matches(topic: str) -> bool:
        parts = topic.split(".")
        if (len(parts) <= width) if tail else (len(parts) != width):
            return False
        return all(want == "*" or want == got for want, got in zip(fixed, parts, strict=False))

    return matches


class Router(Generic[T]):
    """Routes a topic to at most one target per group, first-registered pattern first.

    Results are cached per topic; adding a route clears the cache.
    """

    __slots__ = ("_cache", "_names", "_routes")

    def __init__(self) -> None:
        self._routes: list[tuple[Callable[[str], bool], str, T]] = []
        self._cache: dict[str, tuple[T, ...]] = {}
        self._names: dict[str, tuple[str, ...]] = {}

    @property
    def cache(self) -> dict[str, tuple[T, ...]]:
        """The routes computed so far (topic -> targets); the same dict for ever."""
        return self._cache

    def add(self, pattern: str, group: str, target: T) -> None:
        """Register ``target`` for ``pattern`` in ``group``."""
        self._routes.append((compile_pattern(pattern), group, target))
        self._cache.clear()
        self._names.clear()

    def remove(self, target: T) -> None:
        """Forget every route to ``target``."""
        self._routes = [route for route in self._routes if route[2] is not target]
        self._cache.clear()
        self._names.clear()

    def targets(self) -> Iterable[T]:
        """Every registered target, in registration order."""
        return (target for _, _, target in self._routes)

    def route(self, topic: str) -> tuple[T, ...]:
        """Return the targets ``topic`` goes to: one per group, first match wins."""
        if type(topic) is not str:
            validate_topic(topic)  # an unhashable topic must not reach the cache
        found = self._cache.get(topic)
        if found is not None:
            return found
        validate_topic(topic)
        groups: set[str] = set()
        chosen: list[T] = []
        for matches, group, target in self._routes:
            if group not in groups and matches(topic):
                groups.add(group)
                chosen.append(target)
        result = tuple(chosen)
        if len(self._cache) >= _ROUTE_CACHE_LIMIT:
            self._cache.clear()
            self._names.clear()
        self._cache[topic] = result
        return result

    def names(self, topic: str) -> tuple[str, ...]:
        """The ``name`` of every target of ``topic``, in route order (cached like routes)."""
        found = self._names.get(topic)
        if found is None:
            found = self._names[topic] = tuple(
                str(getattr(target, "name", target)) for target in self.route(topic)
            )
        return found
