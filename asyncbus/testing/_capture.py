"""Record what a bus publishes, for assertions in tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, overload

import anyio

from .._bus import Bus
from .._checks import check_wait
from .._envelope import Envelope
from .._observe import observers
from .._routing import compile_pattern

__all__ = ["Captured", "Record", "capture"]


@dataclass(frozen=True, slots=True)
class Record:
    """One envelope the bus routed while a :func:`capture` was active.

    :ivar topic: the topic it was published to.
    :ivar payload: its payload, as published (not copied).
    :ivar headers: its headers, the bus's own ``asyncbus-`` ones included.
    :ivar envelope: the whole envelope, for ids, slips, correlation and the rest.
    """

    topic: str
    payload: Any
    headers: Mapping[str, str]
    envelope: Envelope


class Captured:
    """What one :func:`capture` recorded, oldest first.

    A sequence of :class:`Record`: ``len(captured)``, ``captured[0]``,
    ``for record in captured``. Every method that takes ``topic`` accepts a
    subscription pattern (``"orders.*"``, ``"orders.>"``) as well as a plain topic.
    """

    __slots__ = ("_pattern", "_records", "_waiters")

    def __init__(self, pattern: str | None = None) -> None:
        self._pattern = compile_pattern(pattern) if pattern is not None else None
        self._records: list[Record] = []
        self._waiters: list[tuple[Callable[[], bool], anyio.Event]] = []

    def _observe(self, envelope: Envelope) -> None:
        if self._pattern is not None and not self._pattern(envelope.topic):
            return
        self._records.append(Record(envelope.topic, envelope.payload, envelope.headers, envelope))
        if self._waiters:
            for done, event in self._waiters:
                if done():
                    event.set()

    @property
    def records(self) -> list[Record]:
        """A copy of every record so far, oldest first."""
        return list(self._records)

    def select(self, topic: str | None = None) -> list[Record]:
        """The records whose topic matches ``topic`` (every record when ``None``)."""
        if topic is None:
            return list(self._records)
        matches = compile_pattern(topic)
        return [record for record in self._records if matches(record.topic)]

    def topics(self) -> list[str]:
        """The topic of every record, in publish order (repeats included)."""
        return [record.topic for record in self._records]

    def payloads(self, topic: str | None = None) -> list[Any]:
        """The payloads published on ``topic`` (on any topic when ``None``), in order."""
        return [record.payload for record in self.select(topic)]

    def envelopes(self, topic: str | None = None) -> list[Envelope]:
        """The envelopes published on ``topic`` (on any topic when ``None``), in order."""
        return [record.envelope for record in self.select(topic)]

    def clear(self) -> None:
        """Forget everything recorded so far; recording goes on."""
        self._records.clear()

    async def wait_for(
        self, count: int = 1, *, topic: str | None = None, timeout: float | None = 5.0
    ) -> list[Record]:
        """Wait until at least ``count`` records match ``topic``, and return them.

        Prefer ``await bus.drain()`` when the work has an end; this is for a test that
        must look while the bus is still busy.

        :raises TimeoutError: when fewer than ``count`` matched within ``timeout`` seconds.
        """

        seconds = check_wait(timeout, "wait_for(timeout)")

        def done() -> bool:
            return len(self.select(topic)) >= count

        if not done():
            event = anyio.Event()
            waiter = (done, event)
            self._waiters.append(waiter)
            try:
                with anyio.fail_after(seconds):
                    await event.wait()
            except TimeoutError:
                got = len(self.select(topic))
                where = "" if topic is None else f" on {topic!r}"
                raise TimeoutError(
                    f"captured {got} of {count} expected envelopes{where} within {timeout}s"
                ) from None
            finally:
                self._waiters.remove(waiter)
        return self.select(topic)

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[Record]:
        return iter(list(self._records))

    @overload
    def __getitem__(self, index: int) -> Record: ...

    @overload
    def __getitem__(self, index: slice) -> list[Record]: ...

    def __getitem__(self, index: int | slice) -> Record | list[Record]:
        return self._records[index]

    def __repr__(self) -> str:
        return f"<Captured {len(self._records)} records: {self.topics()!r}>"


@contextmanager
def capture(bus: Bus, topic: str | None = None) -> Iterator[Captured]:
    """Record every envelope ``bus`` routes inside the ``with`` block.

    That is every publish (including ``publish_nowait``, ``publish_threadsafe`` and
    ``request``), every routing-slip hop, and every replay re-routed by topic. The bus
    may be running or not; recording stops when the block ends, and the
    :class:`Captured` stays readable afterwards.

    :param topic: record only topics matching this pattern (NATS syntax).
    :raises asyncbus.ConfigurationError: when ``topic`` is not a valid pattern.

    Example::

        with capture(bus) as published:
            await bus.publish("orders.created", {"id": 1})
            await bus.drain()
        assert published.payloads("orders.created") == [{"id": 1}]
    """
    captured = Captured(topic)
    observer = captured._observe
    observers(bus).append(observer)
    try:
        yield captured
    finally:
        # Remove this exact observer: another capture may have appended an equal one.
        for index, existing in enumerate(observers(bus)):
            if existing is observer:
                del observers(bus)[index]
                break
