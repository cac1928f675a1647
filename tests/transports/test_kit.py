"""The broker kit: redact, backoff, the ack writer, the owned task group, the asyncio check."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import replace

import anyio
import pytest
from _brokers import BROKERS, names  # type: ignore[import-not-found]

from asyncbus import ConnectError, DeadLetter, DeadLetterReason, Envelope, TransportError
from asyncbus._routing import compile_pattern
from asyncbus.transports import BaseDelivery, NatsTransport
from asyncbus.transports._kit import AckWriter, Backoff, TaskOwner, TopicMatches, redact

pytestmark = [pytest.mark.timeout(10), pytest.mark.backends("asyncio", "uvloop", "trio")]


# -- redact ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://***@127.0.0.1:6379/0"),
        ("redis://app:s3cret@cache:6379/2", "redis://app:***@cache:6379/2"),
        (
            "amqp://guest:s3cret@rabbit/vhost?heartbeat=5",
            "amqp://guest:***@rabbit/vhost?heartbeat=5",
        ),
        # A user name alone may be a token (NATS takes one there).
        ("nats://s3cret@127.0.0.1:4222", "nats://***@127.0.0.1:4222"),
        # IPv6 hosts keep their brackets; a port that does not parse is still shown.
        ("redis://app:s3cret@[::1]:6379/0", "redis://app:***@[::1]:6379/0"),
        ("redis://app:s3cret@host:notaport/0", "redis://app:***@host:notaport/0"),
        # Secrets in the query, and an @ inside the password.
        ("redis://host/0?password=s3cret&db=1", "redis://host/0?password=***&db=1"),
        ("amqp://u:p@ss:s3cret@host/", "amqp://u:***@host/"),
        ("rediss://host/?Token=s3cret", "rediss://host/?Token=***"),
        # Without a scheme (NATS accepts host:port).
        ("app:s3cret@127.0.0.1:4222", "***@127.0.0.1:4222"),
        ("127.0.0.1:4222", "127.0.0.1:4222"),
    ],
)
def test_redact_hides_credentials_and_keeps_the_rest(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert "s3cret" not in redact(url)


def test_every_broker_transport_redacts_with_the_kit() -> None:
    import importlib
    import pkgutil

    import asyncbus.transports as package

    using: set[str] = set()
    for info in pkgutil.iter_modules(package.__path__):
        broker = info.name.lstrip("_").split("_")[0]
        if broker not in ("redis", "nats", "rabbit", "pg", "postgres"):
            continue
        module = importlib.import_module(f"asyncbus.transports.{info.name}")
        if hasattr(module, "redact"):
            assert module.redact is redact, info.name  # one implementation for all
            using.add("pg" if broker == "postgres" else broker)
    assert using == {"redis", "nats", "rabbit", "pg"}  # each family redacts with it
    assert "s3cret" not in repr(NatsTransport("nats://s3cret@[::1]:4222"))


# -- backoff --------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_most_and_resets() -> None:
    backoff = Backoff(0.05, 0.3)
    assert [backoff.next() for _ in range(5)] == [0.05, 0.1, 0.2, 0.3, 0.3]
    backoff.reset()
    assert backoff.next() == 0.05


def test_backoff_with_jitter_stays_in_the_upper_half() -> None:
    backoff = Backoff(1.0, 8.0, jitter=True)
    for bound in (1.0, 2.0, 4.0, 8.0, 8.0):
        pause = backoff.next()
        assert bound / 2 <= pause <= bound


# -- the owned task group --------------------------------------------------------------


@pytest.mark.anyio
async def test_task_owner_runs_tasks_until_it_closes_and_refuses_them_after() -> None:
    owner = TaskOwner("TestTransport")
    with pytest.raises(TransportError, match="TestTransport is not connected"):
        owner.start_soon(anyio.sleep_forever)
    await owner.open()
    started, cleaned = anyio.Event(), anyio.Event()

    async def background() -> None:
        try:
            started.set()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.lowlevel.checkpoint()
                cleaned.set()

    owner.start_soon(background)
    with anyio.fail_after(5):
        await started.wait()
    assert owner.running
    await owner.aclose()
    assert cleaned.is_set()  # cancelled and awaited, its clean-up done
    assert not owner.running
    await owner.aclose()  # twice: nothing happens
    with pytest.raises(TransportError):
        owner.start_soon(anyio.sleep_forever)


# -- the ack writer ---------------------------------------------------------------------


class _Broker:
    """Records written batches; fails the next ``failures`` writes; loses ``gone`` keys."""

    def __init__(self) -> None:
        self.written: list[dict[str, list[int]]] = []
        self.failures = 0
        self.gone: set[str] = set()
        self.wrote = anyio.Event()

    async def write(self, batch: dict[str, list[tuple[int, str | None]]]) -> Collection[str]:
        await anyio.lowlevel.checkpoint()
        if self.failures:
            self.failures -= 1
            raise OSError("connection reset")
        self.written.append({key: [item for item, _ in items] for key, items in batch.items()})
        self.wrote.set()
        return [key for key in batch if key in self.gone]


@contextmanager
def _scope(timeout: float) -> Iterator[anyio.CancelScope]:
    with anyio.CancelScope(shield=True, deadline=anyio.current_time() + timeout) as scope:
        yield scope


@pytest.mark.anyio
async def test_ack_writer_batches_acks_and_retries_a_failed_write() -> None:
    broker = _Broker()
    broker.failures = 1
    writer: AckWriter[str, int] = AckWriter("T", broker.write, _scope, linger=0.001)
    writer.open()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(writer.run)
        writer.queue("s1", "a@g", 1, "e1")
        writer.queue("s1", "a@g", 2, "e2")
        writer.queue("s2", "b@g", 7, None)
        with anyio.fail_after(5):
            await broker.wrote.wait()  # after one failed write and a pause
        tasks.cancel_scope.cancel()
    assert broker.written == [{"s1": [1, 2], "s2": [7]}]
    assert writer.take_lost() == []


@pytest.mark.anyio
async def test_ack_writer_stops_lingering_once_a_key_holds_its_batch() -> None:
    broker = _Broker()
    # A linger far beyond the test's deadline: only a full batch can be written in time.
    writer: AckWriter[str, int] = AckWriter("T", broker.write, _scope, linger=3600)
    writer.open()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(writer.run)
        writer.queue("s1", "a@g", 1, "e1", 3)
        writer.queue("s2", "b@g", 7, "e7", 3)
        writer.queue("s1", "a@g", 2, "e2", 3)
        await anyio.wait_all_tasks_blocked()
        assert broker.written == []  # two of three under s1: still lingering
        writer.queue("s1", "a@g", 3, "e3", 3)
        with anyio.fail_after(5):
            await broker.wrote.wait()
        assert broker.written == [{"s1": [1, 2, 3], "s2": [7]}]  # everything queued goes
        broker.wrote = anyio.Event()
        writer.queue("s1", "a@g", 4, "e4", 3)
        await anyio.wait_all_tasks_blocked()
        assert broker.written == [{"s1": [1, 2, 3], "s2": [7]}]  # lingering again
        for tag in (5, 6):
            writer.queue("s1", "a@g", tag, f"e{tag}", 3)
        with anyio.fail_after(5):
            await broker.wrote.wait()
        tasks.cancel_scope.cancel()
    assert broker.written == [{"s1": [1, 2, 3], "s2": [7]}, {"s1": [4, 5, 6]}]
    assert writer.take_lost() == []


@pytest.mark.anyio
async def test_ack_writer_reports_the_bus_acks_it_lost_once() -> None:
    broker = _Broker()
    broker.gone = {"s1"}
    writer: AckWriter[str, int] = AckWriter("T", broker.write, _scope)
    writer.open()
    writer.queue("s1", "a@g", 1, "e1")
    writer.queue("s1", "a@g", 2, None)  # not the bus's ack: its loss is not reported
    writer.queue("s2", "b@g", 3, "e3")
    await writer.flush()
    assert writer.take_lost() == [("a@g", "e1")]
    assert writer.take_lost() == []
    writer.queue("s3", "c@g", 4, "e4")
    writer.close()  # closed with acks still queued: lost, and no more taken
    assert writer.take_lost() == [("c@g", "e4")]
    with pytest.raises(TransportError, match="T is closed"):
        writer.queue("s3", "c@g", 5, "e5")


@pytest.mark.anyio
async def test_ack_writer_keeps_acks_whose_write_failed() -> None:
    broker = _Broker()
    broker.failures = 1
    writer: AckWriter[str, int] = AckWriter("T", broker.write, _scope)
    writer.open()
    writer.queue("s1", "a@g", 1, "e1")
    with pytest.raises(OSError):
        await writer.flush()
    writer.queue("s1", "a@g", 2, "e2")
    await writer.flush(["s1"])
    assert broker.written == [{"s1": [1, 2]}]  # the failed batch first, in order


# -- asyncio only ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", names())
def test_every_broker_refuses_trio_with_one_error(kind: str) -> None:
    trio = pytest.importorskip("trio")
    broker = BROKERS[kind]
    transport = broker.make(broker.url(1))
    with pytest.raises(ConnectError, match=rf"asyncio only \({broker.client}\), not trio"):
        trio.run(transport.connect)


# -- TopicMatches ---------------------------------------------------------------------


def test_topic_matches_names_the_matching_entries_in_table_order_or_sorted() -> None:
    table = [(compile_pattern("b.*"), "b.*@x"), (compile_pattern("a.>"), "a.>@y")]
    table += [(compile_pattern(">"), "all@z")]
    assert TopicMatches().lookup("b.1", table) == ("b.*@x", "all@z")
    assert TopicMatches(sort=True).lookup("b.1", table[::-1]) == ("all@z", "b.*@x")


def test_topic_matches_remembers_a_topic_until_cleared() -> None:
    matches = TopicMatches()
    table = [(compile_pattern("t"), "t@g")]
    assert matches.lookup("t", table) == ("t@g",)
    table.append((compile_pattern("t"), "t@h"))
    assert matches.lookup("t", table) == ("t@g",)  # cached: the owner did not clear
    matches.clear()
    assert matches.lookup("t", table) == ("t@g", "t@h")


@pytest.mark.anyio
async def test_a_base_delivery_rejected_with_an_entry_stores_that_entry() -> None:
    stored: list[DeadLetter] = []

    class Kept(BaseDelivery):
        async def _reject(self, entry: DeadLetter) -> None:
            stored.append(entry)

    envelope = Envelope(topic="orders", payload=1)
    entry = DeadLetter(
        envelope.evolve(attempt=3), DeadLetterReason.TIMEOUT, "slow", "orders@g", 3, 5.0, "tb"
    )
    await Kept(envelope).reject(entry)
    assert stored == [entry]  # as it is: nothing parsed back from a string
    # An entry whose envelope does not say the last attempt is stored with it.
    stored.clear()
    await Kept(envelope).reject(replace(entry, envelope=envelope))
    assert stored == [entry]
    # The protocol's form still builds one from the reason and its details.
    stored.clear()
    await Kept(envelope).reject("rejected", error="bad", stage="orders@g", attempts=1)
    [built] = stored
    assert (built.reason, built.error, built.stage, built.attempts, built.traceback) == (
        DeadLetterReason.REJECTED,
        "bad",
        "orders@g",
        1,
        None,
    )
