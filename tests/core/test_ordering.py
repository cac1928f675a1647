"""``subscribe(..., ordering="key")``: one envelope of a publish key at a time, in order.

Every handled ``(key, sequence)`` is recorded with its start and end; each key's
sequence must come out exactly in publish order, with no gap but a dead letter, and no
two envelopes of one key may overlap. Parallelism across keys is shown by meeting, not
by timing: handlers of different keys wait for each other to be running at once.
"""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from typing import Any

import anyio
import pytest
from _meeting import Meeting  # type: ignore[import-not-found]

from asyncbus import (
    Adaptive,
    Admission,
    Backpressure,
    Batch,
    Bus,
    ConfigurationError,
    DeadLetterReason,
    Defer,
    Envelope,
    Priority,
    Reject,
    Retry,
    StageStatistics,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


class Journal:
    """Starts and ends of each key's envelopes, with the checks order per key needs."""

    def __init__(self) -> None:
        self.runs: dict[str, list[tuple[int, int, int]]] = defaultdict(
            list
        )  # key -> (seq, start, end)
        self.running: dict[str, int] = defaultdict(int)
        self.most_at_once: dict[str, int] = defaultdict(int)
        self._tick = 0

    def start(self, key: str) -> int:
        self._tick += 1
        self.running[key] += 1
        self.most_at_once[key] = max(self.most_at_once[key], self.running[key])
        return self._tick

    def end(self, key: str, sequence: int, started: int) -> None:
        self._tick += 1
        self.running[key] -= 1
        self.runs[key].append((sequence, started, self._tick))

    def sequences(self) -> dict[str, list[int]]:
        return {key: [sequence for sequence, _, _ in runs] for key, runs in self.runs.items()}

    def assert_one_at_a_time(self) -> None:
        for key, runs in self.runs.items():
            assert self.most_at_once[key] == 1, key
            for (_, _, end), (_, start, _) in itertools.pairwise(runs):
                assert end < start, f"key {key}: an envelope started before the last ended"


def counts(stage: StageStatistics) -> tuple[int, ...]:
    return (stage.published, stage.acked, stage.dead_lettered, stage.depth, stage.in_flight)


async def test_each_key_is_handled_in_publish_order_one_at_a_time_through_retries() -> None:
    bus = Bus()
    journal = Journal()
    chance = random.Random(7)
    failing = {(key, n) for key in range(12) for n in range(30) if chance.random() < 0.2}

    @bus.subscribe(
        "t",
        group="g",
        concurrency=8,
        capacity=64,
        ordering="key",
        retry=Retry(max_attempts=3, backoff=0.001, jitter=False),
    )
    async def handle(envelope: Envelope) -> None:
        key, n = envelope.payload
        started = journal.start(str(key))
        await anyio.sleep(0)
        await anyio.sleep(0)
        if (key, n) in failing and envelope.attempt == 1:
            journal.running[str(key)] -= 1
            raise RuntimeError("transient")
        journal.end(str(key), n, started)

    with anyio.fail_after(20):
        async with bus:
            async with anyio.create_task_group() as publishers:
                for key in range(12):  # one publisher per key: each key's own order
                    publishers.start_soon(_publish_run, bus, key, 30)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert journal.sequences() == {str(key): list(range(30)) for key in range(12)}
    journal.assert_one_at_a_time()
    assert counts(stage) == (360, 360, 0, 0, 0)
    assert (stage.failed, stage.retried) == (len(failing), len(failing))
    assert (stage.ordering, stage.keys_held, stage.keys_waiting, stage.waiting_for_key) == (
        "key",
        0,
        0,
        0,
    )


async def _publish_run(bus: Bus, key: int, count: int) -> None:
    for n in range(count):
        await bus.publish("t", [key, n], key=str(key))


async def test_different_keys_run_at_once_and_one_hot_key_runs_one_at_a_time() -> None:
    bus = Bus()
    all_running = anyio.Event()
    running: set[str] = set()
    hot: list[int] = []
    hot_running = 0
    most_hot = 0

    @bus.subscribe("spread", group="g", concurrency=4, ordering="key")
    async def spread(envelope: Envelope) -> None:
        running.add(envelope.payload)
        if len(running) == 4:
            all_running.set()
        await all_running.wait()  # only returns once four keys run at the same time

    @bus.subscribe("hot", group="h", concurrency=4, ordering="key")
    async def hot_key(n: int) -> None:
        nonlocal hot_running, most_hot
        hot_running += 1
        most_hot = max(most_hot, hot_running)
        for _ in range(3):
            await anyio.sleep(0)
        hot.append(n)
        hot_running -= 1

    with anyio.fail_after(10):
        async with bus:
            for key in "abcd":
                await bus.publish("spread", key, key=key)
            await bus.publish_many("hot", range(40), key="one")
            await bus.drain()
    assert running == {"a", "b", "c", "d"}
    assert hot == list(range(40))
    assert most_hot == 1


async def test_envelopes_without_a_key_are_not_ordered() -> None:
    bus = Bus()
    meeting = Meeting(2)

    @bus.subscribe("t", group="g", concurrency=2, ordering="key")
    async def handle(n: int) -> None:
        await meeting.attend()  # returns once both run at once

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", [1, 2])  # no key: both at once
            await bus.drain()
    assert bus.statistics().stage("t@g").acked == 2


async def test_a_deferred_envelope_keeps_its_key() -> None:
    bus = Bus()
    order: list[str] = []
    deferred: set[str] = set()

    def defer_once(next_handler: Any) -> Any:
        async def layer(envelope: Envelope) -> Any:
            if envelope.payload == "a0" and envelope.payload not in deferred:
                deferred.add(envelope.payload)
                return Defer(0.01)
            return await next_handler(envelope)

        return layer

    @bus.subscribe("t", group="g", concurrency=4, ordering="key", middleware=[defer_once])
    async def handle(name: str) -> None:
        order.append(name)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", ["a0", "a1", "a2"], key="a")
            await bus.publish("t", "b0", key="b")
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert [name for name in order if name[0] == "a"] == ["a0", "a1", "a2"]
    assert "b0" in order
    assert (stage.acked, stage.deferred) == (4, 1)


async def test_a_dead_letter_lets_the_rest_of_its_key_continue_by_default() -> None:
    bus = Bus()
    order: list[str] = []

    @bus.subscribe("t", group="g", concurrency=4, ordering="key")
    async def handle(name: str) -> None:
        if name == "a1":
            raise Reject("bad")
        order.append(name)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", ["a0", "a1", "a2", "a3"], key="a")
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            dead = [entry.envelope.payload for entry in bus.dead_letters.list()]
    assert order == ["a0", "a2", "a3"]
    assert dead == ["a1"]
    assert counts(stage) == (4, 3, 1, 0, 0)


async def test_key_failure_stop_dead_letters_what_waits_for_the_key() -> None:
    bus = Bus()
    order: list[str] = []

    @bus.subscribe(
        "t",
        group="g",
        concurrency=4,
        ordering="key",
        key_failure="stop",
        retry=Retry(max_attempts=2, backoff=0.001, jitter=False),
    )
    async def handle(name: str) -> None:
        if name == "a1":
            raise RuntimeError("broken")
        order.append(name)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", ["a0", "a1", "a2", "a3"], key="a")
            await bus.publish_many("t", ["b0", "b1"], key="b")
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            dead = {entry.envelope.payload: entry for entry in bus.dead_letters.list()}
            # The key is free again: what comes next is handled.
            await bus.publish("t", "a4", key="a")
            await bus.drain()
    assert [name for name in order if name[0] == "a"] == ["a0", "a4"]
    assert [name for name in order if name[0] == "b"] == ["b0", "b1"]
    assert sorted(dead) == ["a1", "a2", "a3"]
    assert dead["a1"].reason is DeadLetterReason.HANDLER_FAILED
    assert dead["a1"].attempts == 2
    assert {dead[name].reason for name in ("a2", "a3")} == {DeadLetterReason.KEY_STOPPED}
    assert {dead[name].attempts for name in ("a2", "a3")} == {0}
    assert counts(stage) == (6, 3, 3, 0, 0)


async def test_statistics_show_the_keys_held_and_waiting() -> None:
    bus = Bus()
    meeting = Meeting(3, hold=anyio.Event())

    @bus.subscribe("t", group="g", concurrency=4, ordering="key")
    async def handle(name: str) -> None:
        await meeting.attend()

    with anyio.fail_after(10):
        async with bus:
            await bus.publish_many("t", ["a0", "a1", "a2"], key="a")
            await bus.publish_many("t", ["b0", "b1"], key="b")
            await bus.publish("t", "c0", key="c")
            await meeting.full.wait()  # a0, b0 and c0 run; the rest wait for their key
            stage = bus.statistics().stage("t@g")
            assert (stage.keys_held, stage.keys_waiting, stage.waiting_for_key) == (3, 2, 3)
            assert (stage.in_flight, stage.depth) == (3, 3)
            assert meeting.hold is not None
            meeting.hold.set()
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert (stage.keys_held, stage.keys_waiting, stage.waiting_for_key) == (0, 0, 0)
    assert counts(stage) == (6, 6, 0, 0, 0)
    assert meeting.most == 3


async def test_a_stop_mid_key_abandons_the_holder_and_everything_waiting_for_it() -> None:
    bus = Bus()
    started = anyio.Event()

    @bus.subscribe("t", group="g", concurrency=2, ordering="key")
    async def handle(name: str) -> None:
        started.set()
        await anyio.sleep_forever()

    with anyio.fail_after(10):
        async with bus:
            receipts = [await bus.publish("t", f"a{n}", key="a") for n in range(4)]
            await started.wait()
            report = await bus.aclose(timeout=0.05)
    assert sorted(report.abandoned) == sorted(receipt.id for receipt in receipts)
    stage = bus.statistics().stage("t@g")
    assert (stage.published, stage.acked, stage.abandoned, stage.depth, stage.in_flight) == (
        4,
        0,
        4,
        0,
        0,
    )


@pytest.mark.parametrize(
    ("policy", "capacity", "accepted", "handled", "dead"),
    [
        (Backpressure.REJECT, 3, [True, True, True, False], ["a0", "a1", "a2", "a3"], []),
        (Backpressure.DROP_OLDEST, 2, [True] * 4, ["a0", "a3", "a4"], ["a1", "a2"]),
    ],
    ids=["reject", "drop oldest"],
)
async def test_envelopes_waiting_for_their_key_take_room_in_the_stage(
    policy: Backpressure, capacity: int, accepted: list[bool], handled: list[str], dead: list[str]
) -> None:
    bus = Bus()
    started = anyio.Event()
    release = anyio.Event()
    order: list[str] = []

    @bus.subscribe(
        "t", group="g", concurrency=2, capacity=capacity, backpressure=policy, ordering="key"
    )
    async def handle(name: str) -> None:
        started.set()
        await release.wait()
        order.append(name)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", "a0", key="a")
            await started.wait()  # a0 in flight: the next ones wait for the key
            receipts = [await bus.publish("t", f"a{n}", key="a") for n in range(1, 5)]
            release.set()
            await bus.drain()
            stage = bus.statistics().stage("t@g")
            dropped = [entry.envelope.payload for entry in bus.dead_letters.list()]
    assert [bool(receipt) for receipt in receipts] == accepted
    assert order == handled
    assert dropped == dead
    rejected = accepted.count(False)
    assert (stage.published, stage.acked, stage.rejected) == (5 - rejected, len(handled), rejected)
    assert (stage.dropped, stage.dead_lettered) == (len(dead), len(dead))


@pytest.mark.parametrize(
    "options",
    [{"concurrency": Adaptive(min=2, max=8)}, {"concurrency": 6, "partitions": 4}],
    ids=["adaptive", "partitions in memory"],
)
async def test_each_keys_order_holds_on_an_adaptive_or_partitioned_stage(
    options: dict[str, Any],
) -> None:
    bus = Bus()
    journal = Journal()

    @bus.subscribe("t", group="g", ordering="key", **options)
    async def handle(envelope: Envelope) -> None:
        key, n = envelope.payload
        started = journal.start(key)
        await anyio.sleep(0)
        journal.end(key, n, started)

    with anyio.fail_after(20):
        async with bus:
            for n in range(20):
                for key in "abcdefgh":
                    await bus.publish("t", [key, n], key=key)
            await bus.drain()
            stage = bus.statistics().stage("t@g")
    assert journal.sequences() == {key: list(range(20)) for key in "abcdefgh"}
    journal.assert_one_at_a_time()
    # In memory one process serves every partition.
    partitions = options.get("partitions")
    assert (stage.partitions, stage.partitions_owned) == (partitions, partitions or 0)


async def test_a_higher_priority_does_not_overtake_its_own_key() -> None:
    bus = Bus()
    started = anyio.Event()
    release = anyio.Event()
    order: list[str] = []

    @bus.subscribe(
        "t", group="g", concurrency=1, ordering="key", admission=Admission(target_wait=10.0)
    )
    async def handle(name: str) -> None:
        started.set()
        await release.wait()
        order.append(name)

    with anyio.fail_after(10):
        async with bus:
            await bus.publish("t", "blocker", key="x")
            await started.wait()
            await bus.publish("t", "a0", key="a")
            await bus.publish("t", "a1", key="a", priority=Priority.HIGH)
            await bus.publish("t", "b0", key="b", priority=Priority.HIGH)
            release.set()
            await bus.drain()
    assert order == ["blocker", "b0", "a0", "a1"]


async def test_ordering_options_are_checked_at_subscribe() -> None:
    bus = Bus()

    async def handle(n: int) -> None:
        pass

    with pytest.raises(ConfigurationError, match="ordering must be None or 'key'"):
        bus.subscribe("t", handle, ordering="partition")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="key_failure must be one of"):
        bus.subscribe("t", handle, ordering="key", key_failure="halt")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs ordering='key'"):
        bus.subscribe("t", handle, key_failure="stop")
    with pytest.raises(ConfigurationError, match="cannot be combined with batch="):
        bus.subscribe("t", handle, ordering="key", batch=Batch(max_size=4))
    with pytest.raises(ConfigurationError, match="cannot be combined with batch="):
        bus.subscribe("t", ordering="key", batch=Batch(max_size=4))  # the decorator form
    bus.subscribe("t", handle, group="g", ordering="key")
    with pytest.raises(ConfigurationError, match="already has ordering='key'"):
        bus.subscribe("t", handle, group="g")
    with pytest.raises(ConfigurationError, match="already has ordering='key'"):
        bus.subscribe("t", group="g", ordering="key", key_failure="stop")


async def test_partitions_are_checked_at_subscribe() -> None:
    bus = Bus()

    async def handle(n: int) -> None:
        pass

    for wrong in (0, 4097, True, 1.5):
        with pytest.raises(
            ConfigurationError, match=r"partitions must be an int >= 1 \(at most 4096\)"
        ):
            bus.subscribe("t", handle, ordering="key", partitions=wrong)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="partitions=4 needs ordering='key'"):
        bus.subscribe("t", handle, partitions=4)
    with pytest.raises(ConfigurationError, match="partitions=4 needs ordering='key'"):
        bus.subscribe("t", partitions=4)
    bus.subscribe("t", handle, group="g", ordering="key", partitions=4)
    with pytest.raises(ConfigurationError, match="already has partitions=4"):
        bus.subscribe("t", handle, group="g", ordering="key", partitions=8)
