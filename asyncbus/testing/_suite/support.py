"""What the conformance suite's tests share: checks with messages, envelopes to send,
deliveries taken under a deadline, and consumers run in tasks of their own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio

from ..._envelope import Envelope
from ...transports.base import BaseDelivery, Delivery, KeepAlive, Transport

#: Seconds the suite waits to prove that nothing (more) arrives.
QUIET = 0.3

#: Seconds past ``ack_timeout`` within which another consumer must get the deliveries of
#: a consumer that stopped settling (the broker's redelivery plus a busy machine's delay).
REDELIVERY_GRACE = 2.0

_FIELDS = (
    "id",
    "topic",
    "payload",
    "headers",
    "timestamp",
    "ttl",
    "slip",
    "correlation_id",
    "causation_id",
    "reply_to",
    "sender",
)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} chars)"


def _check(got: Any, want: Any, what: str) -> None:
    """``assert got == want`` with a message (the suite's asserts are not rewritten)."""
    assert got == want, f"{what}: got {_short(got)}, want {_short(want)}"


def _field(envelope: Envelope, name: str) -> Any:
    value = getattr(envelope, name)
    return dict(value) if name == "headers" else value


def _check_envelope(got: Envelope, sent: Envelope, *, attempt: int | None = 1) -> None:
    """Every field of ``got`` equals ``sent``'s (``attempt`` as given; None: any)."""
    for name in _FIELDS:
        _check(_field(got, name), _field(sent, name), f"envelope.{name} of {sent.id}")
    if attempt is not None:
        _check(got.attempt, attempt, f"envelope.attempt of {sent.id}")


def _envelopes(topic: str, count: int, **fields: Any) -> list[Envelope]:
    return [Envelope(topic=topic, payload={"n": n}, **fields) for n in range(count)]


def _name_of(size: int) -> str:
    """A topic (and pattern) of exactly ``size`` bytes, in dot-separated tokens."""
    token = "abcdefghijklmnopqrstuvwxyz0123456789" * 7  # 252 bytes
    name = ".".join([token] * (size // (len(token) + 1) + 1))
    return name[:size].rstrip(".") + "x" * (size - len(name[:size].rstrip(".")))


def _ids(items: Iterable[Envelope | Delivery]) -> list[str]:
    return [item.id if isinstance(item, Envelope) else item.envelope.id for item in items]


async def _next(deliveries: AsyncIterator[Delivery], timeout: float, what: str) -> BaseDelivery:
    """The next delivery, or fail naming ``what`` did not arrive within ``timeout``.

    The suite checks transports built on asyncbus's base: their deliveries are
    :class:`~asyncbus.transports.BaseDelivery` (``error``, the one ``reject``).
    """
    try:
        with anyio.fail_after(timeout):
            delivery = await anext(deliveries)
    except TimeoutError:
        raise AssertionError(f"no delivery within {timeout} s: {what}") from None
    assert isinstance(delivery, BaseDelivery), f"{delivery!r} is not a BaseDelivery"
    return delivery


async def _take(
    deliveries: AsyncIterator[Delivery], count: int, timeout: float, what: str
) -> list[Delivery]:
    """The next ``count`` deliveries, unsettled."""
    taken: list[Delivery] = []
    try:
        with anyio.fail_after(timeout):
            while len(taken) < count:
                taken.append(await anext(deliveries))
    except TimeoutError:
        raise AssertionError(
            f"{len(taken)} of {count} deliveries within {timeout} s: {what}"
        ) from None
    return taken


class _Inbox:
    """What background consumers received, tagged by consumer, with a way to wait for it."""

    def __init__(self) -> None:
        self.items: list[tuple[str, Delivery]] = []
        self._waiters: list[anyio.Event] = []

    def put(self, consumer: str, delivery: Delivery) -> None:
        self.items.append((consumer, delivery))
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.set()

    def of(self, consumer: str) -> list[Delivery]:
        return [delivery for name, delivery in self.items if name == consumer]

    def count(self, consumer: str | None = None) -> int:
        return len(self.items) if consumer is None else len(self.of(consumer))

    async def wait_until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            with anyio.fail_after(timeout):
                while not condition():
                    waiter = anyio.Event()
                    self._waiters.append(waiter)
                    await waiter.wait()
        except TimeoutError:
            seen = {name: self.count(name) for name, _ in self.items}
            raise AssertionError(f"within {timeout} s: {what} (received so far: {seen})") from None

    async def wait_for(self, count: int, timeout: float, consumer: str | None = None) -> None:
        who = consumer or "all consumers"
        await self.wait_until(
            lambda: self.count(consumer) >= count, timeout, f"{count} deliveries to {who}"
        )

    async def consume(
        self, deliveries: AsyncIterator[Delivery], consumer: str, *, ack: bool = True
    ) -> None:
        """Receive until cancelled; ack each delivery (before recording it) if ``ack``."""
        async for delivery in deliveries:
            if ack:
                await delivery.ack()
            self.put(consumer, delivery)


@contextmanager
def _keep_alive(transport: Transport, value: bool) -> Iterator[None]:
    """``transport.keep_alive`` set to ``value`` for the subscriptions made meanwhile."""
    if not isinstance(transport, KeepAlive):
        yield
        return
    before = transport.keep_alive
    transport.keep_alive = value
    try:
        yield
    finally:
        transport.keep_alive = before


async def _wait(event: anyio.Event, timeout: float, what: str) -> None:
    try:
        with anyio.fail_after(timeout):
            await event.wait()
    except TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None


class _Holder:
    """A consumer in a task of its own: takes deliveries, holds them, leaves when told.

    Its subscription is entered and left in its own task, so the test never exits
    a transport's context (which may hold a task group) out of nesting order.
    """

    def __init__(self, transport: Transport, pattern: str, *, group: str, prefetch: int) -> None:
        self._subscription = transport.subscribe(pattern, group=group, prefetch=prefetch)
        self.taken: list[Delivery] = []
        self.subscribed = anyio.Event()
        self.took = anyio.Event()
        self.leave = anyio.Event()
        self.left = anyio.Event()

    async def run(self, count: int, timeout: float) -> None:
        async with self._subscription as deliveries:
            self.subscribed.set()
            self.taken = await _take(deliveries, count, timeout, "deliveries before leaving")
            self.took.set()
            await self.leave.wait()
        self.left.set()
