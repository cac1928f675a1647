"""deduplicate(): an id handled within the window is acked without running the handler again."""

import asyncio
import importlib.util
from typing import Any

import anyio
import pytest
import sniffio
import trio
import trio.testing

from asyncbus import Bus, ConfigurationError, Envelope, Handler, Retry, StageStatistics, middleware
from asyncbus.middleware import deduplicate
from asyncbus.middleware.deduplicate import Claim, DedupStore, MemoryDedupStore

pytestmark = pytest.mark.anyio


def stage_stats(bus: Bus, name: str) -> StageStatistics:
    (stats,) = [s for s in bus.statistics().stages if s.name == name]
    return stats


async def test_same_id_twice_runs_handler_once_and_acks_both() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.publish("t", 2, id="x")
            await bus.publish("t", 3, id="y")
            await bus.drain()

            assert handled == [1, 3]
            stats = stage_stats(bus, "t@g")
            assert stats.published == 3
            assert stats.acked == 3
            assert stats.dead_lettered == 0
            assert len(bus.dead_letters) == 0


async def test_replayed_dead_letter_is_let_through() -> None:
    seen: list[Envelope] = []

    async def handle(env: Envelope) -> None:
        seen.append(env)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    with anyio.fail_after(5):
        async with bus:
            # Dead-lettered before anyone listens...
            await bus.publish("t", "dead", id="x")
            await bus.drain()
            assert len(bus.dead_letters) == 1
            bus.subscribe("t", handle, group="g")
            # ...then the same id is handled, so the dedup window knows "x".
            await bus.publish("t", "live", id="x")
            await bus.drain()
            await bus.dead_letters.replay("x")
            await bus.drain()
            # A plain duplicate is still suppressed afterwards.
            await bus.publish("t", "again", id="x")
            await bus.drain()

            assert [env.payload for env in seen] == ["live", "dead"]
            replayed = seen[1]
            assert replayed.id == "x"
            assert replayed.attempt == 1
            assert "asyncbus-replayed" in replayed.headers
            assert len(bus.dead_letters) == 0
            stats = stage_stats(bus, "t@g")
            assert stats.published == 3
            assert stats.acked == 3


async def test_entries_older_than_window_are_forgotten() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=0.3, maxlen=1000)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await bus.publish("t", 2, id="x")
            await bus.drain()
            assert handled == [1]

            # Waiting for a clock, not for work: let the window pass.
            await anyio.sleep(0.4)
            await bus.publish("t", 3, id="x")
            await bus.drain()
            assert handled == [1, 3]
            assert stage_stats(bus, "t@g").acked == 3


async def test_maxlen_keeps_only_the_newest_ids() -> None:
    handled: list[Any] = []

    async def handle(payload: Any) -> None:
        handled.append(payload)

    bus = Bus(middleware=[deduplicate(window=60, maxlen=2)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            for key in ("a", "b", "c"):
                await bus.publish("t", key, id=key)
                await bus.drain()
            await bus.publish("t", "a again", id="a")  # "a" was evicted by "c"
            await bus.drain()
            await bus.publish("t", "c again", id="c")  # "c" is still remembered
            await bus.drain()

            assert handled == ["a", "b", "c", "a again"]
            assert stage_stats(bus, "t@g").acked == 5


async def test_failed_attempt_is_not_remembered_so_the_retry_runs() -> None:
    attempts: list[int] = []

    async def flaky(env: Envelope) -> None:
        attempts.append(env.attempt)
        if env.attempt == 1:
            raise RuntimeError("once")

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", flaky, group="g", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()

            assert attempts == [1, 2]
            assert stage_stats(bus, "t@g").acked == 1
            assert len(bus.dead_letters) == 0


async def test_deduplication_is_per_stage_so_fan_out_reaches_every_group() -> None:
    handled: list[tuple[str, Any]] = []

    async def first(payload: Any) -> None:
        handled.append(("first", payload))

    async def second(payload: Any) -> None:
        handled.append(("second", payload))

    bus = Bus(middleware=[deduplicate(window=60, maxlen=1000)])
    bus.subscribe("t", first, group="one")
    bus.subscribe("t", second, group="two")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await bus.publish("t", 2, id="x")
            await bus.drain()

            assert sorted(handled) == [("first", 1), ("second", 1)]
            assert stage_stats(bus, "t@one").acked == 2
            assert stage_stats(bus, "t@two").acked == 2


class RecordingStore:
    """A user's store (the protocol, nothing more) that records every call it gets."""

    def __init__(self) -> None:
        self.inner = MemoryDedupStore()
        self.calls: list[tuple[str, str]] = []

    async def claim(self, key: str, owner: str, lease: float) -> Claim:
        found = await self.inner.claim(key, owner, lease)
        self.calls.append(("claim", f"{key}={found.value}"))
        return found

    async def extend(self, key: str, owner: str, lease: float) -> bool:
        self.calls.append(("extend", key))
        return await self.inner.extend(key, owner, lease)

    async def done(self, key: str, owner: str, ttl: float) -> None:
        self.calls.append(("done", key))
        await self.inner.done(key, owner, ttl)

    async def release(self, key: str, owner: str) -> None:
        self.calls.append(("release", key))
        await self.inner.release(key, owner)


async def test_a_store_is_claimed_before_handling_marked_done_after_and_released_on_failure() -> (
    None
):
    store = RecordingStore()
    assert isinstance(store, DedupStore)
    attempts: list[int] = []

    async def flaky(env: Envelope) -> None:
        attempts.append(env.attempt)
        if env.attempt == 1:
            raise RuntimeError("once")

    bus = Bus(middleware=[deduplicate(store=store)])
    bus.subscribe("t", flaky, group="g", retry=Retry(max_attempts=2, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            await bus.publish("t", 2, id="x")  # a duplicate: skipped at the claim
            await bus.drain()
            stats = stage_stats(bus, "t@g")
    assert attempts == [1, 2]
    assert store.calls == [
        ("claim", "t@g/x=claimed"),
        ("release", "t@g/x"),  # the failed attempt gives it back: the retry may run
        ("claim", "t@g/x=claimed"),
        ("done", "t@g/x"),
        ("claim", "t@g/x=done"),
    ]
    assert (stats.published, stats.acked, stats.dead_lettered) == (2, 2, 0)


async def test_with_a_store_a_duplicate_handled_meanwhile_waits_for_it_then_is_skipped() -> None:
    handled: list[Any] = []
    release = anyio.Event()

    async def slow(payload: Any) -> None:
        handled.append(payload)
        await release.wait()

    bus = Bus(middleware=[deduplicate(store=MemoryDedupStore(), lease=1.0)])
    bus.subscribe("t", slow, group="g", concurrency=2)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", "first", id="x")
            await bus.publish("t", "copy", id="x")
            while not handled:
                await anyio.sleep(0.01)
            # The copy is with the other consumer, waiting on the claim (not handled).
            await anyio.sleep(0.3)
            assert handled == ["first"]
            release.set()
            await bus.drain()
            stats = stage_stats(bus, "t@g")
    assert handled == ["first"]
    assert (stats.published, stats.acked) == (2, 2)


async def test_a_replay_runs_under_a_store_whatever_it_remembers() -> None:
    store = MemoryDedupStore()
    await store.done("t@g/x", "someone", 60)
    handled: list[Envelope] = []

    async def handle(env: Envelope) -> None:
        handled.append(env)

    bus = Bus(middleware=[deduplicate(store=store)])
    bus.subscribe("t", handle, group="g")
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", 1, id="x", headers={"asyncbus-replayed": "1"})
            await bus.publish("t", 2, id="x")
            await bus.drain()
    assert [env.payload for env in handled] == [1]


def test_a_store_that_is_not_one_and_a_bad_lease_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError):
        deduplicate(store=object())  # type: ignore[arg-type]
    for lease in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigurationError):
            deduplicate(lease=lease)


async def test_the_memory_store_claims_once_expires_claims_and_remembers_done() -> None:
    now = [1000.0]
    store = MemoryDedupStore(maxlen=2, clock=lambda: now[0])
    assert await store.claim("k", "a", 5) is Claim.CLAIMED
    assert await store.claim("k", "b", 5) is Claim.BUSY
    assert await store.claim("k", "a", 5) is Claim.CLAIMED  # its own claim again
    now[0] += 4
    assert await store.extend("k", "a", 5) is True
    assert await store.extend("k", "b", 5) is False
    now[0] += 4
    assert await store.claim("k", "b", 5) is Claim.BUSY  # extended: still a's
    now[0] += 2
    assert await store.claim("k", "b", 5) is Claim.CLAIMED  # a's lease ran out
    await store.release("k", "a")  # not a's any more: left alone
    assert await store.claim("k", "c", 5) is Claim.BUSY
    await store.release("k", "b")
    assert await store.claim("k", "c", 5) is Claim.CLAIMED
    await store.done("k", "c", 10)
    assert await store.claim("k", "d", 5) is Claim.DONE
    now[0] += 11
    assert await store.claim("k", "d", 5) is Claim.CLAIMED  # forgotten after the ttl
    await store.done("one", "x", 60)
    await store.done("two", "x", 60)  # maxlen 2: "k" goes
    assert await store.claim("k", "e", 5) is Claim.CLAIMED


class _SkewedLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock the test moves forward (as trio's MockClock jumps)."""

    skew = 0.0

    def time(self) -> float:
        return super().time() + self.skew


def _skewed_uvloop() -> asyncio.AbstractEventLoop:
    import uvloop

    class SkewedUvloop(uvloop.Loop):  # type: ignore[misc]
        skew = 0.0

        def time(self) -> float:
            return float(super().time()) + self.skew

    return SkewedUvloop()


def _jump(seconds: float) -> None:
    """Move the running loop's clock ``seconds`` forward (no other clock moves)."""
    if sniffio.current_async_library() == "trio":
        clock = trio.lowlevel.current_clock()
        assert isinstance(clock, trio.testing.MockClock)
        clock.jump(seconds)
    else:
        loop = asyncio.get_running_loop()
        loop.skew += seconds  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param(("asyncio", {"loop_factory": _SkewedLoop}), id="asyncio"),
        pytest.param(
            ("asyncio", {"loop_factory": _skewed_uvloop}),
            id="uvloop",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
            ),
        ),
        pytest.param(("trio", {"clock": trio.testing.MockClock(rate=1.0)}), id="trio"),
    ],
)
async def test_an_explicit_memory_store_measures_its_window_on_the_loop_clock() -> None:
    handled: list[int] = []

    async def handle(n: int) -> None:
        handled.append(n)

    bus = Bus()
    bus.subscribe(
        "t", handle, group="g", middleware=[deduplicate(window=60, store=MemoryDedupStore())]
    )
    with anyio.fail_after(3600):  # (on the loop's clock, which jumps)
        async with bus:
            await bus.publish("t", 1, id="x")
            await bus.drain()
            _jump(59)
            await bus.publish("t", 2, id="x")  # within the window: a duplicate
            await bus.drain()
            _jump(2)
            await bus.publish("t", 3, id="x")  # the window has passed on the loop's clock
            await bus.drain()
    assert handled == [1, 3]
    assert stage_stats(bus, "t@g").acked == 3


def _counting_entries() -> tuple[Any, anyio.Event]:
    """A middleware to list before ``deduplicate()``, and the event it sets once two
    envelopes entered the chain (each copy is held by a consumer of its own)."""
    both_in = anyio.Event()
    entered: list[str] = []

    @middleware
    async def count_entries(env: Envelope, call_next: Handler) -> Any:
        entered.append(env.id)
        if len(entered) == 2:
            both_in.set()
        return await call_next(env)

    return count_entries, both_in


@pytest.mark.parametrize("outcome", ["succeeds", "fails"])
async def test_a_copy_that_arrives_while_the_first_is_handled_waits_for_its_outcome(
    outcome: str,
) -> None:
    """Without a store: the copy is not run beside the first. It waits, then is skipped
    when the first succeeded, or runs when the first failed."""
    handled: list[str] = []
    gate = anyio.Event()
    count_entries, both_in = _counting_entries()
    bus = Bus(middleware=[count_entries, deduplicate()])

    async def slow(env: Envelope) -> None:
        handled.append(env.payload)
        await gate.wait()
        if env.payload == "first" and outcome == "fails":
            raise RuntimeError("the first copy failed")

    bus.subscribe("t", slow, group="g", concurrency=2)
    with anyio.fail_after(5):
        async with bus:
            await bus.publish("t", "first", id="x")
            await bus.publish("t", "copy", id="x")
            await both_in.wait()
            gate.set()
            await bus.drain()
            stats = stage_stats(bus, "t@g")
    if outcome == "succeeds":
        assert handled == ["first"]
        assert (stats.published, stats.acked, stats.dead_lettered) == (2, 2, 0)
    else:
        assert handled == ["first", "copy"]
        assert (stats.published, stats.acked, stats.dead_lettered) == (2, 1, 1)
