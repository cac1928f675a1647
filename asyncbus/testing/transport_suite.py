"""The conformance suite every transport must pass.

Subclass :class:`TransportSuite` in a test module and provide a ``transport``
fixture that yields an entered transport whose broker names carry a prefix unique
to the test::

    from collections.abc import AsyncIterator

    import pytest

    from asyncbus.testing.transport_suite import TransportSuite
    from asyncbus.transports import RedisTransport, Transport


    class TestRedis(TransportSuite):
        ack_timeout = 1.0

        @pytest.fixture
        def anyio_backend(self) -> str:
            return "asyncio"  # redis-py runs on asyncio only

        @pytest.fixture
        async def transport(self, redis_url: str, unique_prefix: str) -> AsyncIterator[Transport]:
            async with RedisTransport(
                redis_url, prefix=unique_prefix, ack_timeout=self.ack_timeout
            ) as transport:
                yield transport
            # ... delete the broker names under unique_prefix here

        async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
            ...  # publish a valid envelope on ``topic`` whose body is ``body``

What a transport cannot do natively is told by ``transport.capabilities``, and
what it offers beyond the core by the optional protocols it implements
(:class:`~asyncbus.transports.DeadLetterStore`,
:class:`~asyncbus.transports.SharedDeadLetters`,
:class:`~asyncbus.transports.RoutedPublisher`, ...); the tests that need one are
skipped, and a transport that claims one must honour it. The suite relies on one thing beyond the
interface's docstrings: a group exists once ``subscribe`` has been *entered*, so
envelopes published after that reach it even before anyone iterates.

Every wait runs under a deadline (:attr:`TransportSuite.timeout`); the only
sleeps are short ones (:data:`QUIET`) that prove something does *not* arrive.
Failures are ``AssertionError`` with a message, never ``pytest.fail``: a
``BaseException`` escaping a task group stops anyio's test runner before the
``transport`` fixture's teardown, which would leave broker names behind.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import string
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any, ClassVar

import anyio
import pytest

from .._dead_letters import DeadLetter, DeadLetterReason, dead_letter_key
from .._dedup import Claim, DedupStore
from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from ..transports.base import (
    AcksWrittenBehind,
    BacklogReader,
    BaseDelivery,
    DeadLetterChange,
    DeadLetterStore,
    DedupStoreProvider,
    Delivery,
    GroupAdmin,
    GroupPublisher,
    KeepAlive,
    RoutedPublisher,
    SharedDeadLetters,
    SubscriptionControl,
    Transport,
    TransportSettings,
)

__all__ = ["QUIET", "TransportSuite"]

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


class TransportSuite:
    """Tests every transport must pass; subclass it with a ``transport`` fixture.

    The subclass provides:

    * ``transport``: an async-generator fixture yielding an *entered* transport
      whose broker names use a prefix unique to the test (``unique_prefix``), and
      which removes them afterwards.
    * ``anyio_backend`` (optional): a fixture override returning ``"asyncio"``
      when the client library runs on asyncio only.
    * :attr:`ack_timeout` (optional): the ``ack_timeout`` it gives its transport;
      ``None`` (the default) skips the test of a consumer that hangs or dies.
    * :meth:`publish_raw` (optional): publish a body that does not decode.
    """

    #: Seconds after which a dead consumer's deliveries go to another consumer;
    #: ``None`` when the transport has no such timeout (in-process transports).
    ack_timeout: ClassVar[float | None] = None
    #: Deadline in seconds of every wait for something that must arrive.
    timeout: ClassVar[float] = 10.0
    #: Seconds within which a consumer that leaves hands its deliveries to another.
    release_timeout: ClassVar[float] = 2.0
    #: Upper bound on how late a delayed ``nack`` may redeliver, beyond its delay.
    delay_slack: ClassVar[float] = 2.0
    #: Characters in the large-payload test's string payload (1 MiB).
    large_payload_size: ClassVar[int] = 1 << 20
    #: Bytes of the long topic and pattern tried where the transport states no limit.
    unlimited_name_bytes: ClassVar[int] = 16 * 1024

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        """Publish one envelope on ``topic`` whose body is ``body``, raw (override me).

        The envelope's metadata must be valid (a fresh id, ``topic``, attempt 1),
        only the body is taken as is, so the consumer sees a delivery whose
        ``error`` is set and whose payload is ``body``. Routing is the transport's
        as for :meth:`Transport.publish`. The default skips the test that needs it.
        """
        pytest.skip(f"{type(self).__name__} does not implement publish_raw")

    def _require(self, transport: Transport, capability: str) -> None:
        if not getattr(transport.capabilities, capability):
            pytest.skip(f"{type(transport).__name__} lacks capability {capability!r}")

    def _store(self, transport: Transport) -> DeadLetterStore:
        """The transport as a :class:`DeadLetterStore` (the test is skipped otherwise)."""
        if not isinstance(transport, DeadLetterStore):
            pytest.skip(f"{type(transport).__name__} keeps no dead letters")
        return transport

    # -- the contract -------------------------------------------------------------

    @pytest.mark.anyio
    async def test_a_dead_letter_store_is_what_replay_means(self, transport: Transport) -> None:
        """``capabilities.replay`` is claimed exactly by a :class:`DeadLetterStore`."""
        _check(
            isinstance(transport, DeadLetterStore),
            transport.capabilities.replay,
            "isinstance(transport, DeadLetterStore) (capabilities.replay)",
        )

    @pytest.mark.anyio
    async def test_bind_gives_the_bus_settings(self, transport: Transport) -> None:
        """``bind`` takes the bus's settings in one call; the codec only when given."""
        codec = transport.codec
        settings = TransportSettings(dead_letter_ttl=120.0, dead_letter_maxlen=7)
        transport.bind(settings)
        _check(transport.settings, settings, "transport.settings after bind")
        _check(transport.codec, codec, "codec after a bind without one")
        _check(transport.close_deadline, float("inf"), "close deadline after bind (a new life)")

    @pytest.mark.anyio
    async def test_acks_written_behind_reach_the_broker(self, transport: Transport) -> None:
        """An :class:`AcksWrittenBehind` transport's deliveries queue acks (``ack_nowait``)
        that are written within a moment: the group's backlog empties, nothing comes
        back, and no ack is reported unsettled."""
        if not isinstance(transport, AcksWrittenBehind):
            pytest.skip(f"{type(transport).__name__} awaits its acks")
        sent = _envelopes("behind", 5)
        async with transport.subscribe("behind", group="g", prefetch=5) as deliveries:
            await transport.publish("behind", sent)
            for _ in sent:
                delivery = await _next(deliveries, self.timeout, "a published envelope")
                assert delivery.acks_behind, f"{delivery!r} does not write its acks behind"
                delivery.ack_nowait()
                with pytest.raises(TransportError):
                    delivery.ack_nowait()
            if isinstance(transport, BacklogReader):
                await self._backlog_becomes(transport, "behind", "g", 0)
        async with transport.subscribe("behind", group="g", prefetch=5) as deliveries:
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"an acked envelope came back: {extra.envelope!r}")
        _check(transport.unsettled_acks(), [], "acks reported unsettled")

    @pytest.mark.anyio
    async def test_dedup_store_claims_once(self, transport: Transport) -> None:
        """A :class:`DedupStoreProvider`'s store: one owner claims, others find it busy,
        then done; a released claim can be claimed again."""
        if not isinstance(transport, DedupStoreProvider):
            pytest.skip(f"{type(transport).__name__} keeps no dedup store")
        store = transport.dedup_store(60.0)
        assert isinstance(store, DedupStore), f"{store!r} is not a DedupStore"
        key, other = f"suite@g:{secrets.token_hex(6)}", f"suite@g:{secrets.token_hex(6)}"
        _check(await store.claim(key, "first", 30.0), Claim.CLAIMED, "the first claim")
        _check(await store.claim(key, "second", 30.0), Claim.BUSY, "a second owner's claim")
        _check(await store.extend(key, "first", 30.0), True, "the owner extends")
        _check(await store.extend(key, "second", 30.0), False, "another owner extends")
        await store.done(key, "first", 60.0)
        _check(await store.claim(key, "second", 30.0), Claim.DONE, "a claim once done")
        _check(await store.claim(other, "first", 30.0), Claim.CLAIMED, "another key")
        await store.release(other, "first")
        _check(await store.claim(other, "second", 30.0), Claim.CLAIMED, "a released key")

    # -- publish and subscribe ----------------------------------------------------

    @pytest.mark.anyio
    async def test_publish_subscribe_round_trip_preserves_every_field(
        self, transport: Transport
    ) -> None:
        """Payload, headers, timing and correlation fields arrive as they were sent."""
        sent = Envelope(
            topic="orders.created",
            payload={"n": 1, "name": "Zoë", "items": [1, 2.5, None, True, "ü"], "empty": {}},
            headers={"tenant": "acme", "trace": "00-abc-01"},
            ttl=3600.0,
            slip=("orders.billed", "orders.shipped"),
            correlation_id="correlation-1",
            causation_id="cause-1",
            reply_to="replies.one",
            sender="transport-suite",
        )
        async with transport.subscribe("orders.created", group="g", prefetch=10) as deliveries:
            await transport.publish("orders.created", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            _check(delivery.error, None, "delivery.error")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_publish_routed_names_the_groups_reached_or_dead_letters(
        self, transport: Transport
    ) -> None:
        """``publish_routed`` names the groups it reached (sorted); with none, it publishes
        nothing and keeps a ``no_subscribers`` dead letter. (A transport that cannot
        tell returns ``None`` and is not held to it.)"""
        if not isinstance(transport, RoutedPublisher):
            pytest.skip(f"{type(transport).__name__} is not a RoutedPublisher")
        lost = Envelope(topic="routed.nobody", payload="lost")
        reached = await transport.publish_routed("routed.nobody", [lost])
        if reached is None:
            pytest.skip(f"{type(transport).__name__} cannot tell which groups it reached")
        _check(reached, (), "groups reached by a topic nobody subscribes to")
        if isinstance(transport, DeadLetterStore):
            listed = [e for e in await transport.dead_letters() if e.envelope.id == lost.id]
            _check(len(listed), 1, "dead letters of the unrouted envelope")
            _check(listed[0].reason, DeadLetterReason.NO_SUBSCRIBERS, "its reason")
            _check(listed[0].envelope.payload, "lost", "its payload")
        sent = Envelope(topic="routed.items", payload="found")
        async with (
            transport.subscribe("routed.*", group="b", prefetch=1) as second,
            transport.subscribe("routed.items", group="a", prefetch=1) as first,
        ):
            reached = await transport.publish_routed("routed.items", [sent])
            _check(reached, ("routed.*@b", "routed.items@a"), "groups reached")
            for deliveries in (first, second):
                delivery = await _next(deliveries, self.timeout, "the routed envelope")
                _check_envelope(delivery.envelope, sent)
                await delivery.ack()

    @pytest.mark.anyio
    async def test_correlation_id_defaults_to_the_envelope_id(self, transport: Transport) -> None:
        """An envelope without explicit correlation keeps its own id as correlation id."""
        sent = Envelope(topic="plain", payload="text")
        async with transport.subscribe("plain", group="g", prefetch=1) as deliveries:
            await transport.publish("plain", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            _check_envelope(delivery.envelope, sent)
            _check(delivery.envelope.correlation_id, sent.id, "correlation_id")
            await delivery.ack()

    @pytest.mark.anyio
    async def test_publish_of_a_batch_delivers_each_envelope_once(
        self, transport: Transport
    ) -> None:
        """One publish call with many envelopes delivers each of them exactly once."""
        sent = _envelopes("batch", 25)
        inbox = _Inbox()
        async with (
            transport.subscribe("batch", group="g", prefetch=10) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("batch", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("c"))), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_a_batch_of_deliveries_held_at_once_settles_in_any_order(
        self, transport: Transport
    ) -> None:
        """What a batch consumer does: hold ``prefetch`` deliveries, then settle them last
        first, most acked and some rejected; each is settled once and none comes back."""
        sent = _envelopes("held", 12)
        async with transport.subscribe("held", group="g", prefetch=len(sent)) as deliveries:
            await transport.publish("held", sent)
            held = [
                await _next(deliveries, self.timeout, f"delivery {n + 1} of {len(sent)}")
                for n in range(len(sent))
            ]
            _check(sorted(_ids(held)), sorted(_ids(sent)), "ids held at once")
            rejected = []
            for position, delivery in reversed(list(enumerate(held))):
                if position % 4 == 1:
                    rejected.append(delivery.envelope.id)
                    await delivery.reject(DeadLetterReason.REJECTED.value, stage="held@g")
                else:
                    await delivery.ack()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"a settled envelope came back: {extra.envelope!r}")
        if isinstance(transport, DeadLetterStore):
            entries = await transport.dead_letters()
            _check(sorted(_ids(entry.envelope for entry in entries)), sorted(rejected), "dead")

    @pytest.mark.anyio
    async def test_publish_of_200_envelopes_reaches_one_consumer_once_each_in_order(
        self, transport: Transport
    ) -> None:
        """A batch as ``Bus.publish_many`` writes it (one ``publish`` call): each envelope
        exactly once, and in publish order for one consumer where ``capabilities.ordered``.
        """
        sent = _envelopes("bulk", 200)
        inbox = _Inbox()
        async with (
            transport.subscribe("bulk", group="g", prefetch=50) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("bulk", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)  # a duplicate would arrive meanwhile
            tg.cancel_scope.cancel()
        got = _ids(inbox.of("c"))
        if transport.capabilities.ordered:
            _check(got, _ids(sent), "ids in delivery order")
        else:
            _check(sorted(got), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_fan_out_gives_every_group_every_envelope(self, transport: Transport) -> None:
        """Two groups on one pattern each receive all envelopes, exactly once."""
        sent = _envelopes("events.fan", 10)
        inbox = _Inbox()
        async with (
            transport.subscribe("events.fan", group="one", prefetch=5) as first,
            transport.subscribe("events.fan", group="two", prefetch=5) as second,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, first, "one")
            tg.start_soon(inbox.consume, second, "two")
            for envelope in sent:
                await transport.publish("events.fan", [envelope])
            await inbox.wait_for(len(sent), self.timeout, "one")
            await inbox.wait_for(len(sent), self.timeout, "two")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        for group in ("one", "two"):
            _check(sorted(_ids(inbox.of(group))), sorted(_ids(sent)), f"ids to group {group}")

    @pytest.mark.anyio
    async def test_second_publish_of_an_envelope_id_is_dropped(self, transport: Transport) -> None:
        """Where ``capabilities.dedup``: the broker keeps one envelope per id."""
        self._require(transport, "dedup")
        sent, marker = Envelope(topic="dedup", payload=1), Envelope(topic="dedup", payload=2)
        inbox = _Inbox()
        async with (
            transport.subscribe("dedup", group="g", prefetch=5) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("dedup", [sent])
            await transport.publish("dedup", [sent, marker])
            await inbox.wait_until(
                lambda: marker.id in _ids(inbox.of("c")), self.timeout, "the marker envelope"
            )
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("c"))), sorted([sent.id, marker.id]), "ids delivered")

    @pytest.mark.anyio
    async def test_competing_consumers_split_the_envelopes_of_a_group(
        self, transport: Transport
    ) -> None:
        """Two consumers of one group: each envelope goes to exactly one of them."""
        sent = _envelopes("work", 40)
        inbox = _Inbox()
        async with (
            transport.subscribe("work", group="workers", prefetch=4) as first,
            transport.subscribe("work", group="workers", prefetch=4) as second,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, first, "first")
            tg.start_soon(inbox.consume, second, "second")
            await transport.publish("work", sent)
            await inbox.wait_for(len(sent), self.timeout)
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        first_ids, second_ids = _ids(inbox.of("first")), _ids(inbox.of("second"))
        _check(len(first_ids) + len(second_ids), len(sent), "deliveries in all")
        _check(set(first_ids) & set(second_ids), set(), "ids delivered to both consumers")
        _check(sorted(first_ids + second_ids), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_consumer_at_its_prefetch_leaves_the_rest_to_another(
        self, transport: Transport
    ) -> None:
        """A consumer holding ``prefetch`` unsettled deliveries gets no more; a peer does."""
        sent = _envelopes("work", 4)
        async with transport.subscribe("work", group="workers", prefetch=1) as busy:
            await transport.publish("work", sent)
            held = await _next(busy, self.timeout, "a first delivery to the busy consumer")
            inbox = _Inbox()
            async with (
                transport.subscribe("work", group="workers", prefetch=10) as idle,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, idle, "idle")
                await inbox.wait_for(len(sent) - 1, self.timeout, "idle")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
            await held.ack()
        got = _ids(inbox.of("idle"))
        _check(sorted([held.envelope.id, *got]), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_prefetch_bounds_the_unsettled_deliveries(self, transport: Transport) -> None:
        """No more than ``prefetch`` deliveries are unsettled at once; settling makes room."""
        prefetch = 3
        sent = _envelopes("bounded", 8)
        inbox = _Inbox()
        async with (
            transport.subscribe("bounded", group="g", prefetch=prefetch) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(inbox.consume, ack=False), deliveries, "c")
            await transport.publish("bounded", sent)
            await inbox.wait_for(prefetch, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch, "unsettled deliveries with a full prefetch")
            await inbox.items[0][1].ack()
            await inbox.wait_for(prefetch + 1, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch + 1, "deliveries after settling one")
            await inbox.items[1][1].nack()
            await inbox.items[2][1].reject(DeadLetterReason.REJECTED.value)
            await inbox.wait_for(prefetch + 3, self.timeout)
            await anyio.sleep(QUIET)
            _check(inbox.count(), prefetch + 3, "deliveries after settling three")
            for _, delivery in inbox.items[3:]:
                await delivery.ack()
            await inbox.wait_for(len(sent) + 1, self.timeout)  # + 1: the nacked one again
            tg.cancel_scope.cancel()
        _check(sorted(set(_ids(d for _, d in inbox.items))), sorted(_ids(sent)), "ids delivered")

    @pytest.mark.anyio
    async def test_set_prefetch_gives_back_uncounted_what_it_received_beyond(
        self, transport: Transport
    ) -> None:
        """A :class:`SubscriptionControl` subscription brought down to one while it holds
        one delivery handed out gives back what it received beyond: a peer gets those, not
        as redeliveries; the one handed out stays."""
        async with transport.subscribe("resize", group="g", prefetch=4) as probe:
            steered = isinstance(probe, SubscriptionControl)
        if not steered:
            pytest.skip(f"{type(transport).__name__}'s subscriptions keep their prefetch")
        sent = _envelopes("resize", 4)
        inbox = _Inbox()
        async with transport.subscribe("resize", group="g", prefetch=4) as first:
            assert isinstance(first, SubscriptionControl)
            await transport.publish("resize", sent)
            held = await _next(first, self.timeout, "a first delivery")
            await first.set_prefetch(1)
            async with (
                transport.subscribe("resize", group="g", prefetch=4) as peer,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, peer, "peer")
                await inbox.wait_for(len(sent) - 1, self.timeout, "peer")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
            await held.ack()
            await first.flush()
        got = inbox.of("peer")
        _check(sorted([held.envelope.id, *_ids(got)]), sorted(_ids(sent)), "ids delivered")
        _check(
            [d.redeliveries for d in got if isinstance(d, BaseDelivery)],
            [0] * (len(sent) - 1),
            "redeliveries of what was given back",
        )

    # -- settling -------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_acked_envelope_is_not_delivered_again(self, transport: Transport) -> None:
        """After ``ack``, leaving and re-subscribing to the group delivers only new work."""
        first, marker = Envelope(topic="acked", payload=1), Envelope(topic="acked", payload=2)
        async with transport.subscribe("acked", group="g", prefetch=5) as deliveries:
            await transport.publish("acked", [first])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.ack()
        async with transport.subscribe("acked", group="g", prefetch=5) as deliveries:
            await transport.publish("acked", [marker])
            delivery = await _next(deliveries, self.timeout, "the second envelope")
            _check(delivery.envelope.id, marker.id, "id after re-subscribing")
            await delivery.ack()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"acked envelope came back: {extra.envelope!r}")

    @pytest.mark.anyio
    async def test_nack_redelivers_with_the_next_attempt(self, transport: Transport) -> None:
        """``nack()`` redelivers the same envelope, ``attempt`` counting deliveries."""
        sent = Envelope(topic="retry", payload={"x": "ÿ"}, headers={"k": "v"})
        async with transport.subscribe("retry", group="g", prefetch=1) as deliveries:
            await transport.publish("retry", [sent])
            for attempt in (1, 2, 3):
                delivery = await _next(deliveries, self.timeout, f"attempt {attempt}")
                _check_envelope(delivery.envelope, sent, attempt=attempt)
                if attempt < 3:
                    await delivery.nack()
            await delivery.ack()

    @pytest.mark.anyio
    async def test_nack_with_delay_redelivers_after_the_delay(self, transport: Transport) -> None:
        """``nack(delay=)`` redelivers no sooner than the delay (and not much later)."""
        self._require(transport, "delayed_nack")
        delay = 0.5
        sent = Envelope(topic="later", payload="p")
        async with transport.subscribe("later", group="g", prefetch=1) as deliveries:
            await transport.publish("later", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            started = anyio.current_time()
            await delivery.nack(delay=delay)
            again = await _next(
                deliveries, delay + self.delay_slack, f"redelivery after nack(delay={delay})"
            )
            elapsed = anyio.current_time() - started
            assert elapsed >= delay, f"redelivered after {elapsed:.3f} s, before the {delay} s"
            _check_envelope(again.envelope, sent, attempt=2)
            await again.ack()

    @pytest.mark.anyio
    async def test_delayed_nack_does_not_hold_up_other_envelopes(
        self, transport: Transport
    ) -> None:
        """While one envelope waits out its delay, the consumer gets the next ones."""
        self._require(transport, "delayed_nack")
        delayed, other = Envelope(topic="later", payload=1), Envelope(topic="later", payload=2)
        async with transport.subscribe("later", group="g", prefetch=1) as deliveries:
            await transport.publish("later", [delayed])
            delivery = await _next(deliveries, self.timeout, "the first envelope")
            started = anyio.current_time()
            await delivery.nack(delay=5.0)
            await transport.publish("later", [other])
            next_one = await _next(deliveries, self.timeout, "the second envelope")
            _check(next_one.envelope.id, other.id, "envelope delivered during the delay")
            assert anyio.current_time() - started < 5.0, "waited for the delayed envelope"
            await next_one.ack()

    @pytest.mark.anyio
    async def test_settling_twice_raises_transport_error(self, transport: Transport) -> None:
        """A delivery is settled exactly once: a second ack/nack/reject raises."""
        async with transport.subscribe("twice", group="g", prefetch=1) as deliveries:
            await transport.publish("twice", [Envelope(topic="twice", payload=1)])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.ack()
            with pytest.raises(TransportError):
                await delivery.nack()
            with pytest.raises(TransportError):
                await delivery.reject(DeadLetterReason.REJECTED.value)

    @pytest.mark.anyio
    async def test_reject_stores_a_dead_letter(self, transport: Transport) -> None:
        """``reject`` keeps the envelope, reason, error, stage and attempts; no redelivery."""
        sent = Envelope(topic="poison", payload={"bad": True}, headers={"h": "é"})
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.nack()
            delivery = await _next(deliveries, self.timeout, "the nacked envelope")
            before = time.time()
            await delivery.reject(
                DeadLetterReason.HANDLER_FAILED.value,
                error="ValueError: boom",
                stage="poison@g",
            )
            after = time.time()
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"rejected envelope came back: {extra.envelope!r}")
        if not isinstance(transport, DeadLetterStore):
            return
        entries = await transport.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        entry = entries[0]
        _check_envelope(entry.envelope, sent, attempt=None)
        _check(entry.reason, DeadLetterReason.HANDLER_FAILED, "reason")
        _check(entry.error, "ValueError: boom", "error")
        _check(entry.stage, "poison@g", "stage")
        _check(entry.attempts, 2, "attempts")
        assert before - 1.0 <= entry.dead_at <= after + 1.0, (
            f"dead_at {entry.dead_at} not within [{before}, {after}]"
        )

    @pytest.mark.anyio
    async def test_reject_with_only_a_reason(self, transport: Transport) -> None:
        """``reject(reason)`` without error or stage stores ``None`` for both."""
        store = self._store(transport)
        sent = Envelope(topic="poison", payload=[1, 2])
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.reject(DeadLetterReason.REJECTED.value)
        entries = await store.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        _check(entries[0].reason, DeadLetterReason.REJECTED, "reason")
        _check((entries[0].error, entries[0].stage), (None, None), "(error, stage)")
        _check(entries[0].attempts, 1, "attempts")
        _check(entries[0].envelope.payload, [1, 2], "payload")

    @pytest.mark.anyio
    async def test_reject_records_the_last_attempt_the_bus_ran(self, transport: Transport) -> None:
        """``reject(attempts=N)``: retries ran in the bus, the dead letter says N."""
        store = self._store(transport)
        sent = Envelope(topic="poison", payload="retried")
        async with transport.subscribe("poison", group="g", prefetch=1) as deliveries:
            await transport.publish("poison", [sent])
            delivery = await _next(deliveries, self.timeout, "the published envelope")
            await delivery.reject(
                DeadLetterReason.HANDLER_FAILED.value,
                error="ValueError: third time",
                stage="poison@g",
                attempts=3,
            )
        entries = await store.dead_letters()
        _check([entry.envelope.id for entry in entries], [sent.id], "dead letter ids")
        _check((entries[0].attempts, entries[0].envelope.attempt), (3, 3), "attempts")
        _check(entries[0].error, "ValueError: third time", "error")

    # -- the dead-letter store ------------------------------------------------------

    def _dead_letter(self, payload: Any, *, dead_at: float | None = None) -> DeadLetter:
        envelope = Envelope(topic="dead.stored", payload=payload, headers={"why": "ü"})
        return DeadLetter(
            envelope,
            DeadLetterReason.EXPIRED,
            None,
            "dead.*@g",
            3,
            time.time() if dead_at is None else dead_at,
        )

    @pytest.mark.anyio
    async def test_added_dead_letters_are_listed_oldest_first(self, transport: Transport) -> None:
        """``add_dead_letter`` entries come back from ``dead_letters`` in order, intact."""
        store = self._store(transport)
        now = time.time()
        added = [self._dead_letter({"n": n}, dead_at=now - 10 + n) for n in range(3)]
        for entry in added:
            await store.add_dead_letter(entry)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), _ids(e.envelope for e in added), "ids")
        for got, want in zip(listed, added, strict=True):
            _check_envelope(got.envelope, want.envelope, attempt=want.envelope.attempt)
            for name in ("reason", "error", "stage", "attempts"):
                _check(getattr(got, name), getattr(want, name), f"dead letter {name}")
            assert abs(got.dead_at - want.dead_at) < 1e-3, f"dead_at {got.dead_at}"

    @pytest.mark.anyio
    async def test_remove_dead_letters_forgets_those_ids(self, transport: Transport) -> None:
        """``remove_dead_letters`` drops the given ids, keeps the others; no ids: none."""
        store = self._store(transport)
        added = [self._dead_letter(n) for n in range(3)]
        for entry in added:
            await store.add_dead_letter(entry)
        await store.remove_dead_letters([])
        _check(len(await store.dead_letters()), 3, "dead letters after removing none")
        await store.remove_dead_letters([added[0].envelope.id, added[2].envelope.id])
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [added[1].envelope.id], "remaining ids")
        await store.remove_dead_letters(["no-such-id"])
        _check(len(await store.dead_letters()), 1, "dead letters after an unknown id")

    @pytest.mark.anyio
    async def test_dead_letters_past_their_ttl_are_dropped(self, transport: Transport) -> None:
        """Entries older than the bound ``dead_letter_ttl`` are no longer listed."""
        store = self._store(transport)
        transport.bind(TransportSettings(dead_letter_ttl=60.0))
        old = self._dead_letter("old", dead_at=time.time() - 120)
        young = self._dead_letter("young")
        await store.add_dead_letter(old)
        await store.add_dead_letter(young)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [young.envelope.id], "ids within the ttl")

    @pytest.mark.anyio
    async def test_dead_letters_beyond_maxlen_drop_the_oldest(self, transport: Transport) -> None:
        """At most the bound ``dead_letter_maxlen`` entries are kept, the newest ones."""
        store = self._store(transport)
        transport.bind(TransportSettings(dead_letter_maxlen=2))
        added = [self._dead_letter(n) for n in range(4)]
        for entry in added:
            await store.add_dead_letter(entry)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), _ids(e.envelope for e in added[2:]), "ids kept")

    # -- a store every process shares ---------------------------------------------

    def _shared(self, transport: Transport) -> SharedDeadLetters:
        """The transport as :class:`SharedDeadLetters` (the test is skipped otherwise)."""
        if not isinstance(transport, SharedDeadLetters):
            pytest.skip(f"{type(transport).__name__} shares no dead letters")
        return transport

    @pytest.mark.anyio
    async def test_taking_dead_letters_is_a_claim(self, transport: Transport) -> None:
        """Of concurrent ``take_dead_letters`` of one id, one gets each of its entries
        (every stage's), once; the other gets none; what was not asked for stays."""
        shared = self._shared(transport)
        store = self._store(transport)
        wanted = self._dead_letter("twice")
        other_stage = dataclasses.replace(wanted, stage="dead.stored@other")
        kept = self._dead_letter("kept")
        for entry in (wanted, other_stage, kept):
            await store.add_dead_letter(entry)
        takes: list[list[DeadLetter]] = []

        async def take() -> None:
            takes.append(await shared.take_dead_letters([wanted.envelope.id]))

        with anyio.fail_after(self.timeout):
            async with anyio.create_task_group() as group:
                for _ in range(3):
                    group.start_soon(take)
        got = sorted(entry.stage or "" for taken in takes for entry in taken)
        _check(got, ["dead.*@g", "dead.stored@other"], "stages taken, over three takes")
        _check(sorted(len(taken) for taken in takes), [0, 0, 2], "entries per take")
        (winner,) = [taken for taken in takes if taken]
        _check_envelope(winner[0].envelope, wanted.envelope, attempt=None)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [kept.envelope.id], "ids left")
        _check(await shared.take_dead_letters(["no-such-id"]), [], "take of an unknown id")

    @pytest.mark.anyio
    async def test_watchers_hear_of_every_change(self, transport: Transport) -> None:
        """A watcher is told of each entry added and taken out (by its key), and to read
        the store again after a purge of everything or entries put back."""
        shared = self._shared(transport)
        store = self._store(transport)
        entry = self._dead_letter("watched")
        key = dead_letter_key(entry)
        async with shared.watch_dead_letters() as changes:

            async def next_change(what: str) -> DeadLetterChange:
                try:
                    with anyio.fail_after(self.timeout):
                        return await anext(changes)
                except TimeoutError:
                    raise AssertionError(f"no change within {self.timeout} s: {what}") from None

            await store.add_dead_letter(entry)
            added = await next_change("the entry added")
            _check([dead_letter_key(e) for e in added.added], [key], "keys added")
            _check_envelope(added.added[0].envelope, entry.envelope, attempt=None)
            (taken,) = await shared.take_dead_letters([entry.envelope.id])
            removed = await next_change("the entry taken")
            _check((list(removed.removed), removed.stale), ([key], False), "keys removed")

            async def until_stale(what: str) -> None:
                change = await next_change(what)
                while not change.stale:  # (an addition may come first)
                    _check(change.removed, (), f"keys removed before: {what}")
                    change = await next_change(what)

            await shared.restore_dead_letters([taken])
            await until_stale("read again, after the entry was put back")
            listed = await store.dead_letters()
            _check(_ids(e.envelope for e in listed), [entry.envelope.id], "ids put back")
            await shared.clear_dead_letters()
            await until_stale("read again, after a purge of everything")
            _check(await store.dead_letters(), [], "dead letters after a purge of everything")

    # -- consumers that leave or die ----------------------------------------------

    @pytest.mark.anyio
    async def test_consumer_that_leaves_releases_its_unsettled_deliveries(
        self, transport: Transport
    ) -> None:
        """Leaving ``subscribe`` without settling hands the deliveries to another consumer.

        Promptly (:attr:`release_timeout`), not after an ack timeout. The attempt is
        not asserted exactly: the reference keeps it (no handler saw the envelope),
        a broker may count the delivery.
        """
        sent = _envelopes("leave", 3)
        inbox = _Inbox()
        async with transport.subscribe("leave", group="g", prefetch=3) as leaving:
            await transport.publish("leave", sent)
            taken = await _take(leaving, 3, self.timeout, "deliveries before leaving")
        async with (
            transport.subscribe("leave", group="g", prefetch=3) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(taken)), "ids released")
        for delivery in inbox.of("survivor"):
            sent_one = next(e for e in sent if e.id == delivery.envelope.id)
            _check_envelope(delivery.envelope, sent_one, attempt=None)
            assert delivery.envelope.attempt in (1, 2), f"attempt {delivery.envelope.attempt}"

    @pytest.mark.anyio
    async def test_consumer_cancelled_while_waiting_releases_what_it_holds(
        self, transport: Transport
    ) -> None:
        """The bus's shutdown: the pump is cancelled mid-wait holding unsettled deliveries."""
        sent = _envelopes("cancelled", 3)
        held = _Inbox()
        async with (
            transport.subscribe("cancelled", group="g", prefetch=5) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(functools.partial(held.consume, ack=False), deliveries, "held")
            await transport.publish("cancelled", sent)
            await held.wait_for(len(sent), self.timeout)
            tg.cancel_scope.cancel()
        inbox = _Inbox()
        async with (
            transport.subscribe("cancelled", group="g", prefetch=5) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_leaving_under_cancellation_still_releases(self, transport: Transport) -> None:
        """Clean-up is shielded: a subscription left by a cancelled task still hands back."""
        sent = _envelopes("shielded", 2)
        with anyio.CancelScope() as scope:
            async with transport.subscribe("shielded", group="g", prefetch=2) as deliveries:
                await transport.publish("shielded", sent)
                await _take(deliveries, len(sent), self.timeout, "deliveries before leaving")
                scope.cancel()
                await anyio.sleep_forever()
        assert scope.cancelled_caught, "the cancelled scope did not end the subscription"
        inbox = _Inbox()
        async with (
            transport.subscribe("shielded", group="g", prefetch=2) as survivor,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, survivor, "survivor")
            await inbox.wait_for(len(sent), self.release_timeout, "survivor")
            tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("survivor"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_consumer_that_leaves_while_another_waits_wakes_it(
        self, transport: Transport
    ) -> None:
        """A consumer already waiting for work gets the deliveries another one releases."""
        sent = _envelopes("leave", 2)
        inbox = _Inbox()
        holder = _Holder(transport, "leave", group="g", prefetch=2)
        async with anyio.create_task_group() as outer:
            outer.start_soon(holder.run, len(sent), self.timeout)
            await _wait(holder.subscribed, self.timeout, "the first consumer to subscribe")
            await transport.publish("leave", sent)
            await _wait(holder.took, self.timeout, "the first consumer to take its deliveries")
            async with (
                transport.subscribe("leave", group="g", prefetch=2) as waiting,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, waiting, "waiting")
                await anyio.sleep(QUIET)
                _check(inbox.count(), 0, "deliveries while the first consumer holds them")
                holder.leave.set()
                await inbox.wait_for(len(sent), self.release_timeout, "waiting")
                tg.cancel_scope.cancel()
        _check(sorted(_ids(inbox.of("waiting"))), sorted(_ids(sent)), "ids released")

    @pytest.mark.anyio
    async def test_deliveries_of_a_dead_consumer_go_to_another_after_ack_timeout(
        self, transport: Transport
    ) -> None:
        """A consumer that stops settling (hung, or killed) loses its deliveries.

        Within ``ack_timeout`` + ``REDELIVERY_GRACE`` another consumer of the group gets
        them, as the next attempt; when the dead consumer finally leaves, nothing comes
        twice.
        (A transport that keeps held deliveries alive, ``keep_alive``, is tested with
        it off: with it on, only a dead process loses them.)
        """
        if self.ack_timeout is None:
            pytest.skip(f"{type(transport).__name__} has no ack timeout")
        with _keep_alive(transport, False):
            await self._check_hung_consumer_loses_its_delivery(transport)

    async def _check_hung_consumer_loses_its_delivery(self, transport: Transport) -> None:
        assert self.ack_timeout is not None
        sent = Envelope(topic="crash", payload="work")
        inbox = _Inbox()
        dead = _Holder(transport, "crash", group="g", prefetch=1)
        async with anyio.create_task_group() as outer:
            outer.start_soon(dead.run, 1, self.timeout)
            await _wait(dead.subscribed, self.timeout, "the consumer that dies to subscribe")
            await transport.publish("crash", [sent])
            await _wait(dead.took, self.timeout, "a delivery to the consumer that dies")
            async with (
                transport.subscribe("crash", group="g", prefetch=1) as survivor,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, survivor, "survivor")
                await inbox.wait_for(1, self.ack_timeout + REDELIVERY_GRACE, "survivor")
                # A redelivery, not the first delivery: attempt 2 normally; on a loaded
                # machine the broker may have redelivered once more before the
                # survivor's pull took it, so only "more than one" is a contract.
                got = inbox.of("survivor")[0].envelope
                _check_envelope(got, sent, attempt=None)
                assert got.attempt >= 2, f"envelope.attempt of {sent.id}: {got.attempt}"
                dead.leave.set()
                await _wait(dead.left, self.timeout, "the dead consumer to leave")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        _check(inbox.count(), 1, "deliveries to the survivor (after the dead one left)")

    @pytest.mark.anyio
    async def test_a_live_consumer_keeps_what_it_holds_past_ack_timeout(
        self, transport: Transport
    ) -> None:
        """With ``keep_alive`` (the default where a transport has it), a delivery held
        longer than ``ack_timeout`` by a live consumer (a long handler, a retry
        waiting) goes to nobody else; when that consumer leaves, another gets it once.
        """
        if self.ack_timeout is None:
            pytest.skip(f"{type(transport).__name__} has no ack timeout")
        if not (isinstance(transport, KeepAlive) and transport.keep_alive):
            pytest.skip(f"{type(transport).__name__} does not keep held deliveries alive")
        sent = Envelope(topic="long", payload="work")
        inbox = _Inbox()
        holder = _Holder(transport, "long", group="g", prefetch=1)
        async with anyio.create_task_group() as outer:
            outer.start_soon(holder.run, 1, self.timeout)
            await _wait(holder.subscribed, self.timeout, "the holding consumer to subscribe")
            await transport.publish("long", [sent])
            await _wait(holder.took, self.timeout, "a delivery to the holding consumer")
            async with (
                transport.subscribe("long", group="g", prefetch=1) as other,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(inbox.consume, other, "other")
                await anyio.sleep(self.ack_timeout * 2.5)
                _check(inbox.count(), 0, "deliveries to another consumer while it is held")
                holder.leave.set()
                await _wait(holder.left, self.timeout, "the holding consumer to leave")
                await inbox.wait_for(1, self.release_timeout + self.ack_timeout, "other")
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        _check(inbox.count(), 1, "deliveries to the other consumer")
        _check(_ids(inbox.of("other")), [sent.id], "the id it got")

    # -- routing --------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_patterns_route_by_token(self, transport: Transport) -> None:
        """``*`` matches exactly one token, ``>`` one or more; exact patterns match one topic."""
        topics = ["shop", "shop.orders", "shop.users", "shop.orders.created", "other.orders"]
        groups = {
            "exact": ("shop.orders", {"shop.orders"}),
            "star": ("shop.*", {"shop.orders", "shop.users"}),
            "tail": ("shop.>", {"shop.orders", "shop.users", "shop.orders.created"}),
            "middle": ("*.orders", {"shop.orders", "other.orders"}),
            "all": (">", set(topics)),
        }
        inbox = _Inbox()
        async with AsyncExitStack() as stack:
            subscriptions = {
                group: await stack.enter_async_context(
                    transport.subscribe(pattern, group=group, prefetch=10)
                )
                for group, (pattern, _) in groups.items()
            }
            async with anyio.create_task_group() as tg:
                for group, deliveries in subscriptions.items():
                    tg.start_soon(inbox.consume, deliveries, group)
                for topic in topics:
                    await transport.publish(topic, [Envelope(topic=topic, payload=topic)])
                for group, (_, expected) in groups.items():
                    await inbox.wait_for(len(expected), self.timeout, group)
                await anyio.sleep(QUIET)
                tg.cancel_scope.cancel()
        for group, (pattern, expected) in groups.items():
            got = sorted(d.envelope.topic for d in inbox.of(group))
            _check(got, sorted(expected), f"topics delivered to {pattern!r}")

    @pytest.mark.anyio
    async def test_publish_to_group_reaches_only_that_group(self, transport: Transport) -> None:
        """``publish_to_group`` (replay) delivers to the named group and no other."""
        if not isinstance(transport, GroupPublisher):
            pytest.skip(f"{type(transport).__name__} is not a GroupPublisher")
        sent = Envelope(topic="replayed.one", payload="again", headers={"asyncbus-replayed": "1"})
        inbox = _Inbox()
        async with (
            transport.subscribe("replayed.*", group="target", prefetch=5) as target,
            transport.subscribe("replayed.*", group="bystander", prefetch=5) as bystander,
            transport.subscribe("replayed.one", group="target", prefetch=5) as other_pattern,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, target, "target")
            tg.start_soon(inbox.consume, bystander, "bystander")
            tg.start_soon(inbox.consume, other_pattern, "other_pattern")
            await transport.publish_to_group("replayed.*", "target", [sent])
            await inbox.wait_for(1, self.timeout, "target")
            await anyio.sleep(QUIET)
            tg.cancel_scope.cancel()
        _check(_ids(inbox.of("target")), [sent.id], "ids to the target group")
        _check_envelope(inbox.of("target")[0].envelope, sent)
        _check(inbox.count("bystander"), 0, "deliveries to another group")
        _check(inbox.count("other_pattern"), 0, "deliveries to the group on another pattern")

    @pytest.mark.anyio
    async def test_one_consumer_sees_one_topic_in_publish_order(self, transport: Transport) -> None:
        """Where ``capabilities.ordered``: publish order is delivery order for one consumer."""
        self._require(transport, "ordered")
        sent = _envelopes("ordered", 30)
        inbox = _Inbox()
        async with (
            transport.subscribe("ordered", group="g", prefetch=7) as deliveries,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(inbox.consume, deliveries, "c")
            await transport.publish("ordered", sent[:10])
            for envelope in sent[10:20]:
                await transport.publish("ordered", [envelope])
            await transport.publish("ordered", sent[20:])
            await inbox.wait_for(len(sent), self.timeout)
            tg.cancel_scope.cancel()
        _check(_ids(inbox.of("c")), _ids(sent), "ids in delivery order")

    # -- names the broker can carry ----------------------------------------------------

    @pytest.mark.anyio
    async def test_names_at_the_limits_are_carried_and_longer_ones_refused(
        self, transport: Transport
    ) -> None:
        """The longest pattern and topic :attr:`Transport.limits` allow work end to end
        (16 KiB where there is no limit); one byte more is a :class:`ConfigurationError`
        before anything reaches the broker, and the transport goes on as before."""
        limits = transport.limits
        most = limits.max_pattern_bytes or self.unlimited_name_bytes
        name = _name_of(most)
        assert len(name.encode()) <= (limits.max_topic_bytes or most), "topic over its limit"
        sent = Envelope(topic=name, payload="long")
        async with transport.subscribe(name, group="g", prefetch=1) as deliveries:
            await transport.publish(name, [sent])
            delivery = await _next(deliveries, self.timeout, "the envelope on the longest name")
            _check(delivery.envelope.topic, name, "topic")
            await delivery.ack()
            refused: list[tuple[str, Callable[[], Any]]] = []
            if limits.max_topic_bytes is not None:
                longer = _name_of(limits.max_topic_bytes + 1)
                refused.append(("topic", functools.partial(transport.check_topic, longer)))
                refused.append(
                    ("publish", functools.partial(transport.publish, longer, [sent.evolve()]))
                )
            if limits.max_pattern_bytes is not None:
                longer = _name_of(limits.max_pattern_bytes + 1)
                refused.append(("pattern", functools.partial(transport.check_pattern, longer)))
            for what, call in refused:
                with pytest.raises(ConfigurationError):
                    outcome = call()
                    if hasattr(outcome, "__await__"):
                        await outcome
                    raise AssertionError(f"{what} one byte over the limit was taken")
            after = Envelope(topic=name, payload="after")
            await transport.publish(name, [after])
            delivery = await _next(deliveries, self.timeout, "an envelope after the refusals")
            _check_envelope(delivery.envelope, after)
            await delivery.ack()

    # -- bodies and headers ---------------------------------------------------------

    @pytest.mark.anyio
    async def test_large_payload_arrives_whole(self, transport: Transport) -> None:
        """A 1 MiB string payload survives the trip."""
        size = self.large_payload_size
        alphabet = string.ascii_letters + string.digits
        payload = (alphabet * (size // len(alphabet) + 1))[:size]
        sent = Envelope(topic="large", payload=payload)
        async with transport.subscribe("large", group="g", prefetch=1) as deliveries:
            await transport.publish("large", [sent])
            delivery = await _next(deliveries, self.timeout, "the large envelope")
            _check(len(delivery.envelope.payload), size, "payload length")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_headers_keep_unicode_values(self, transport: Transport) -> None:
        """Header values with non-ASCII text, spaces, quotes, and empty ones arrive intact."""
        headers = {
            "greeting": "grüß dich, 世界 🌍",
            "empty": "",
            "spaced": "  a  b  ",
            "quoted": "\"quoted\" 'single' \\ back",
            "json-like": '{"a": [1, 2]}',
            "long": "x" * 2000,
        }
        sent = Envelope(topic="headers", payload=None, headers=headers)
        async with transport.subscribe("headers", group="g", prefetch=1) as deliveries:
            await transport.publish("headers", [sent])
            delivery = await _next(deliveries, self.timeout, "the envelope with headers")
            _check(dict(delivery.envelope.headers), headers, "headers")
            _check_envelope(delivery.envelope, sent)
            await delivery.ack()

    @pytest.mark.anyio
    async def test_undecodable_body_is_delivered_with_an_error(self, transport: Transport) -> None:
        """A body the codec cannot read arrives with ``error`` set and the raw bytes."""
        if type(self).publish_raw is TransportSuite.publish_raw:
            pytest.skip(f"{type(self).__name__} does not implement publish_raw")
        body = b"\xff\xfe not a valid body {"
        async with transport.subscribe("raw.*", group="g", prefetch=1) as deliveries:
            await self.publish_raw(transport, "raw.bytes", body)
            delivery = await _next(deliveries, self.timeout, "the undecodable envelope")
            assert isinstance(delivery.error, str), f"delivery.error is {delivery.error!r}"
            assert delivery.error, "delivery.error is empty"
            _check(delivery.envelope.payload, body, "payload of an undecodable body")
            _check(delivery.envelope.topic, "raw.bytes", "topic")
            await delivery.reject(DeadLetterReason.REJECTED.value, error=delivery.error)
        if isinstance(transport, DeadLetterStore):
            entries = await transport.dead_letters()
            _check(len(entries), 1, "dead letters after rejecting it")
            _check(entries[0].envelope.payload, body, "dead letter payload")

    # -- backlog --------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_backlog_counts_what_the_group_has_not_settled(
        self, transport: Transport
    ) -> None:
        """``backlog`` counts a group's envelopes until they are acked or rejected."""
        if not isinstance(transport, BacklogReader):
            pytest.skip(f"{type(transport).__name__} is not a BacklogReader")
        sent = _envelopes("pending", 5)
        async with transport.subscribe("pending", group="g", prefetch=5) as deliveries:
            _check(await transport.backlog("pending", "g"), 0, "backlog of a new group")
            await transport.publish("pending", sent)
            _check(await transport.backlog("pending", "g"), 5, "backlog after publishing 5")
            taken = await _take(deliveries, 2, self.timeout, "two deliveries")
            await taken[0].ack()
            await taken[1].reject(DeadLetterReason.REJECTED.value)
            await self._backlog_becomes(transport, "pending", "g", 3)
            rest = await _take(deliveries, 3, self.timeout, "the other deliveries")
            for delivery in rest:
                await delivery.ack()
            await self._backlog_becomes(transport, "pending", "g", 0)
        _check(await transport.backlog("pending", "other"), 0, "backlog of an unknown group")

    async def _backlog_becomes(
        self, transport: BacklogReader, pattern: str, group: str, expected: int
    ) -> None:
        # A broker may apply an ack asynchronously: poll its count under a deadline.
        count = -1
        with anyio.move_on_after(self.timeout):
            while (count := await transport.backlog(pattern, group)) != expected:
                await anyio.sleep(0.02)
        _check(count, expected, f"backlog of ({pattern!r}, {group!r})")

    # -- groups -----------------------------------------------------------------------

    @pytest.mark.anyio
    async def test_groups_are_listed_and_a_deleted_one_gets_nothing_more(
        self, transport: Transport
    ) -> None:
        """:class:`~asyncbus.transports.GroupAdmin`: every group with its backlog, the one
        nobody reads with no consumer; a deleted group is gone, later publishes neither
        reach nor name it, and deleting it again says it was not there."""
        if not isinstance(transport, GroupAdmin):
            pytest.skip(f"{type(transport).__name__} is not a GroupAdmin")
        async with transport.subscribe("listed.*", group="kept", prefetch=5):
            async with transport.subscribe("listed.*", group="gone", prefetch=5):
                pass  # the group outlives its subscription
            await transport.publish("listed.one", _envelopes("listed.one", 2))
            listed = {(info.pattern, info.group): info for info in await transport.groups()}
            _check(sorted(listed), [("listed.*", "gone"), ("listed.*", "kept")], "groups")
            gone, kept = listed["listed.*", "gone"], listed["listed.*", "kept"]
            _check((gone.backlog, gone.consumers), (2, 0), "backlog and consumers of 'gone'")
            _check((kept.backlog, kept.local), (2, False), "backlog of 'kept', local")
            _check(await transport.delete_group("listed.*", "gone"), True, "first deletion")
            _check(await transport.delete_group("listed.*", "gone"), False, "second deletion")
            _check(
                [(info.group, info.backlog) for info in await transport.groups()],
                [("kept", 2)],
                "groups after the deletion",
            )
            if isinstance(transport, RoutedPublisher):
                reached = await transport.publish_routed("listed.two", _envelopes("listed.two", 1))
                if reached is not None:
                    _check(reached, ("listed.*@kept",), "groups a later publish reached")
            else:
                await transport.publish("listed.two", _envelopes("listed.two", 1))
            _check(
                [(info.group, info.backlog) for info in await transport.groups()],
                [("kept", 3)],
                "groups after a later publish",
            )
