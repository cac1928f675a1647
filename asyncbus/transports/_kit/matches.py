"""Which recorded groups a topic reaches, worked out once per topic."""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["Matcher", "TopicMatches"]

#: A compiled pattern: does it match this topic?
Matcher = Callable[[str], bool]

#: Topics remembered before the cache starts again (topics can be unbounded, e.g. ids).
_LIMIT = 4096


class TopicMatches:
    """A bounded per-topic cache of the names whose pattern matches the topic.

    The owner keeps the table of ``(matcher, name)`` pairs and calls :meth:`clear` whenever
    it changes; :meth:`lookup` matches the table only for a topic not seen since.

    :param sort: give the names sorted (else in the table's order).
    """

    __slots__ = ("_found", "_sort")

    def __init__(self, *, sort: bool = False) -> None:
        self._found: dict[str, tuple[str, ...]] = {}
        self._sort = sort

    def clear(self) -> None:
        """Forget every topic's names (the table changed)."""
        self._found = {}

    def lookup(self, topic: str, table: Iterable[tuple[Matcher, str]]) -> tuple[str, ...]:
        """The names of ``table`` whose matcher matches ``topic``."""
        found = self._found.get(topic)
        if found is None:
            names = (name for matches, name in table if matches(topic))
            found = tuple(sorted(names)) if self._sort else tuple(names)
            if len(self._found) >= _LIMIT:
                self._found.clear()
            self._found[topic] = found
        return found
