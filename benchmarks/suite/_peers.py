"""The peers users would otherwise pick: FastStream's in-memory test broker, and bubus.

Both are imported lazily (``pip install -e '.[bench]'``); the core never needs them.

* FastStream has no in-memory broker; its test clients run a broker's subscribers
  in-process with no server, inline from ``publish`` (there is no queue). Two are
  measured: ``TestNatsBroker``, the fastest here (a NATS queue group delivers to its
  first member), and ``TestRabbitBroker``, which builds an ``AsyncMock`` channel for
  every message and is about ten times slower. Targets are judged on the fastest.
* bubus processes events one at a time in a loop task and caps pending events at
  100, so the publisher keeps a window of dispatched events and awaits the oldest.
"""

from __future__ import annotations

import collections
import importlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from time import perf_counter
from typing import Any

from ._baselines import FAN_OUT, SLIP_STAGES, WORKERS
from ._model import Payload, Sample, Tally, settle

__all__ = ["FASTSTREAM_NATS", "FASTSTREAM_RABBIT", "bubus_available", "bubus_runners"]

Run = Callable[[Sequence[Payload]], Awaitable[Sample]]


def _importable(name: str) -> str | None:
    """``None`` when ``name`` imports, else why not."""
    try:
        importlib.import_module(name)
    except ImportError as error:
        return f"not installed: {error.name or name} (pip install -e '.[bench]')"
    return None


# -- FastStream ------------------------------------------------------------------------


def _fs_counter(tally: Tally) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def handle(payload: dict[str, Any]) -> None:
        tally.n += 1

    return handle


def _fs_echo(tally: Tally) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    async def handle(payload: dict[str, Any]) -> dict[str, Any]:
        tally.n += 1
        return payload

    return handle


class _FastStream:
    """The workloads on one of FastStream's test clients (subclasses say which)."""

    module = ""
    broker_name = ""
    client_name = ""

    def available(self) -> str | None:
        return _importable(self.module)

    def _broker(self) -> Any:
        return getattr(importlib.import_module(self.module), self.broker_name)()

    async def _publish_all(
        self, broker: Any, messages: Sequence[Payload], *target: Any, **options: Any
    ) -> float:
        client_type = getattr(importlib.import_module(self.module), self.client_name)
        async with client_type(broker) as client:
            await settle()
            publish = client.publish
            started = perf_counter()
            for message in messages:
                await publish(message, *target, **options)
            return perf_counter() - started

    async def one(self, messages: Sequence[Payload]) -> Sample:
        tally = Tally()
        broker = self._broker()
        broker.subscriber("bench.one")(_fs_counter(tally))
        seconds = await self._publish_all(broker, messages, "bench.one")
        return Sample(seconds, len(messages), tally.n)

    async def fan_out(self, messages: Sequence[Payload]) -> Sample:
        """Three plain subscribers on one subject each get every message."""
        tally = Tally()
        broker = self._broker()
        for _ in range(FAN_OUT):
            broker.subscriber("bench.fan")(_fs_counter(tally))
        seconds = await self._publish_all(broker, messages, "bench.fan")
        return Sample(seconds, len(messages), tally.n)

    async def work_queue(self, messages: Sequence[Payload]) -> Sample:
        raise NotImplementedError

    async def slip(self, messages: Sequence[Payload]) -> Sample:
        """Subscriber → ``@broker.publisher`` chains: each stage returns the payload onward."""
        tally = Tally()
        broker = self._broker()
        topics = [f"bench.slip.{index}" for index in range(SLIP_STAGES)]
        for topic, onward in itertools.pairwise(topics):
            broker.subscriber(topic)(broker.publisher(onward)(_fs_echo(tally)))
        broker.subscriber(topics[-1])(_fs_counter(tally))
        seconds = await self._publish_all(broker, messages, topics[0])
        return Sample(seconds, len(messages), tally.n)

    async def request(self, messages: Sequence[Payload]) -> Sample:
        """``await client.request(payload, subject)``; the subscriber echoes the payload."""
        tally = Tally()
        broker = self._broker()
        broker.subscriber("bench.rr")(_fs_echo(tally))
        client_type = getattr(importlib.import_module(self.module), self.client_name)
        latencies: list[float] = []
        async with client_type(broker) as client:
            await settle()
            request = client.request
            started = perf_counter()
            for message in messages:
                sent = perf_counter()
                await request(message, "bench.rr")
                latencies.append(perf_counter() - sent)
            seconds = perf_counter() - started
        return Sample(seconds, len(messages), tally.n, tuple(latencies))

    def runners(self) -> dict[str, Run | str]:
        """Runner per workload key, or why this client cannot run that workload."""
        return {
            "1": self.one,
            "2": self.fan_out,
            "3": self.work_queue,
            "4": self.slip,
            "5": self.request,
            "6": "no built-in retry, per-message expiry or dedup to switch on; "
            "the test client ignores ack/nack",
            "7": "measured against the raw stream only",
            "8": "batch consume is not compared with peers",
        }


class _Nats(_FastStream):
    """``TestNatsBroker``: the fastest FastStream test client here."""

    module = "faststream.nats"
    broker_name = "NatsBroker"
    client_name = "TestNatsBroker"

    async def work_queue(self, messages: Sequence[Payload]) -> Sample:
        """Four subscribers in one NATS queue group: each message goes to one of them."""
        tally = Tally()
        broker = self._broker()
        for _ in range(WORKERS):
            broker.subscriber("bench.work", queue="workers")(_fs_counter(tally))
        seconds = await self._publish_all(broker, messages, "bench.work")
        return Sample(seconds, len(messages), tally.n)


class _Rabbit(_FastStream):
    """``TestRabbitBroker``: builds a mock channel per message, about 10x slower."""

    module = "faststream.rabbit"
    broker_name = "RabbitBroker"
    client_name = "TestRabbitBroker"

    async def fan_out(self, messages: Sequence[Payload]) -> Sample:
        """A fanout exchange bound to three queues, one subscriber each."""
        rabbit = importlib.import_module(self.module)
        exchange = rabbit.RabbitExchange("bench.fan", type=rabbit.ExchangeType.FANOUT)
        tally = Tally()
        broker = self._broker()
        for index in range(FAN_OUT):
            broker.subscriber(rabbit.RabbitQueue(f"bench.fan.{index}"), exchange)(
                _fs_counter(tally)
            )
        seconds = await self._publish_all(broker, messages, exchange=exchange)
        return Sample(seconds, len(messages), tally.n)

    def runners(self) -> dict[str, Run | str]:
        runners = super().runners()
        runners["3"] = "the test client calls every subscriber of a queue: no competing consumers"
        return runners


FASTSTREAM_NATS = _Nats()
FASTSTREAM_RABBIT = _Rabbit()


# -- bubus -----------------------------------------------------------------------------

_names = itertools.count()
_events: dict[str, Any] = {}
#: bubus refuses a dispatch past 100 pending events; keep well below it.
_WINDOW = 32


def bubus_available() -> str | None:
    """``None`` when bubus imports, else the reason it does not."""
    return _importable("bubus")


def _event(name: str) -> Any:
    """A ``BaseEvent`` subclass named ``name`` with one field, ``data`` (made once)."""
    if name not in _events:
        bubus = importlib.import_module("bubus")
        pydantic = importlib.import_module("pydantic")
        _events[name] = pydantic.create_model(
            name, __base__=bubus.BaseEvent, data=(dict[str, Any], ...)
        )
    return _events[name]


def _event_bus() -> Any:
    bubus = importlib.import_module("bubus")
    return bubus.EventBus(name=f"asyncbus_bench_{next(_names)}")


def _bb_counter(tally: Tally) -> Callable[[Any], Awaitable[None]]:
    async def handle(event: Any) -> None:
        tally.n += 1

    return handle


async def _bb_dispatch(
    bus: Any, event_type: Any, messages: Sequence[Payload], window: int
) -> float:
    """Dispatch every message as an event, at most ``window`` pending; wait until idle."""
    await settle()
    pending: collections.deque[Any] = collections.deque()
    dispatch = bus.dispatch
    try:
        started = perf_counter()
        for message in messages:
            if len(pending) >= window:
                await pending.popleft()
            pending.append(dispatch(event_type(data=message)))
        for event in pending:
            await event
        await bus.wait_until_idle()
        return perf_counter() - started
    finally:
        await bus.stop(clear=True)


async def bb_one(messages: Sequence[Payload]) -> Sample:
    tally = Tally()
    bus = _event_bus()
    event_type = _event("BenchOne")
    bus.on(event_type, _bb_counter(tally))
    seconds = await _bb_dispatch(bus, event_type, messages, _WINDOW)
    return Sample(seconds, len(messages), tally.n)


async def bb_fan_out(messages: Sequence[Payload]) -> Sample:
    """Three handlers on one event type: bubus runs all of them for each event."""
    tally = Tally()
    bus = _event_bus()
    event_type = _event("BenchFan")
    for index in range(FAN_OUT):
        handler = _bb_counter(tally)
        # bubus warns about two handlers of one name on one event type: name them apart.
        handler.__name__ = handler.__qualname__ = f"handle_{index}"
        bus.on(event_type, handler)
    seconds = await _bb_dispatch(bus, event_type, messages, _WINDOW)
    return Sample(seconds, len(messages), tally.n)


async def bb_slip(messages: Sequence[Payload]) -> Sample:
    """Three event types; each handler dispatches (and awaits) the next as a child event.

    Awaited child events are bubus's way to chain; an unawaited child is never
    seen complete once the bounded history drops its parent, and the run hangs.
    """
    tally = Tally()
    bus = _event_bus()
    stages = [_event(f"BenchSlip{index}") for index in range(SLIP_STAGES)]

    def hop(onward: Any) -> Callable[[Any], Awaitable[None]]:
        async def handle(event: Any) -> None:
            tally.n += 1
            await bus.dispatch(onward(data=event.data))

        return handle

    for stage, onward in itertools.pairwise(stages):
        bus.on(stage, hop(onward))
    bus.on(stages[-1], _bb_counter(tally))
    seconds = await _bb_dispatch(bus, stages[0], messages, _WINDOW // 2)
    return Sample(seconds, len(messages), tally.n)


async def bb_request(messages: Sequence[Payload]) -> Sample:
    """``await bus.dispatch(event).event_result()``; the handler returns the payload."""
    tally = Tally()
    bus = _event_bus()
    event_type = _event("BenchRequest")

    async def answer(event: Any) -> Any:
        tally.n += 1
        return event.data

    bus.on(event_type, answer)
    latencies: list[float] = []
    try:
        await settle()
        dispatch = bus.dispatch
        started = perf_counter()
        for message in messages:
            sent = perf_counter()
            await dispatch(event_type(data=message)).event_result()
            latencies.append(perf_counter() - sent)
        seconds = perf_counter() - started
    finally:
        await bus.stop(clear=True)
    return Sample(seconds, len(messages), tally.n, tuple(latencies))


def bubus_runners() -> dict[str, Run | str]:
    """bubus runner per workload key, or why it cannot run that workload."""
    return {
        "1": bb_one,
        "2": bb_fan_out,
        "3": "no competing consumers: every handler of an event type runs for every event",
        "4": bb_slip,
        "5": bb_request,
        "6": "no per-message expiry or deduplication",
        "7": "measured against the raw stream only",
        "8": "batch consume is not compared with peers",
    }
