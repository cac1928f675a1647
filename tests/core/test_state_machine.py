"""A hypothesis state machine drives one bus through random workloads, checking the ledger.

Rules interleave subscribing (every back-pressure policy, retries, timeouts, async and
thread-offloaded handlers), publishing (``publish`` with a deadline or in the
background, ``publish_nowait``, ``publish_threadsafe`` from the loop and from another
thread), handler outcomes (ok, raise, flaky, hang, a stray cancellation, reject),
``drain``, ``replay`` and ``aclose`` with random deadlines (or cancelled). After every
step the bus's own ledger must balance, and the machine's record of each envelope
(admitted where, acked, dead-lettered) must agree with it; once the bus has closed,
every envelope admitted to a stage has ended exactly once: acked, dead-lettered, or
listed as abandoned. (Rejections at the door are never admitted.)

Hypothesis state machines are synchronous: each example runs its own event loop on the
backend under test in a blocking portal, and every rule runs on that loop.

A bounded run is part of every ``pytest``; ``pytest -m soak`` runs many more examples.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import queue
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import anyio.from_thread
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from asyncbus import (
    Adaptive,
    Admission,
    Backpressure,
    Bus,
    BusClosedError,
    ConfigurationError,
    DeadLetter,
    Envelope,
    Handler,
    PublishTimeout,
    Receipt,
    Reject,
    Retry,
    ShutdownReport,
    middleware,
)

BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(
        ("asyncio", {"use_uvloop": True}),
        id="uvloop",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
        ),
    ),
    pytest.param(("trio", {}), id="trio"),
]

TOPICS = ["t.a", "t.b", "t.c"]
PATTERNS = ["t.a", "t.b", "t.*", "$deadletter"]
GROUPS = ["g1", "g2"]
OUTCOMES = ["ok", "ok", "ok", "raise", "flaky", "hang", "cancel", "reject"]
DEADLETTER_STAGE = "$deadletter@"
#: Longest a single step may take before the machine calls it a deadlock.
STEP_LIMIT = 30

#: pattern, group, concurrency, capacity, policy, attempts, timeout, offload, control
SUBSCRIPTIONS = st.tuples(
    st.sampled_from(PATTERNS),
    st.sampled_from(GROUPS),
    st.integers(1, 3),
    st.integers(1, 4),
    st.sampled_from(list(Backpressure)),
    st.integers(1, 3),
    st.sampled_from([None, None, 0.02]),
    st.sampled_from([None, None, "thread"]),
    st.sampled_from([None, None, "adaptive", "admission"]),
)
#: The shedding a controlled stage does: quick to start, so it happens in a short run.
SHEDDING = Admission(target_wait=0.002, interval=0.005)
#: Handler outcomes for a batch of publishes.
BATCHES = st.lists(st.sampled_from(OUTCOMES), min_size=1, max_size=6)


class BusMachine(RuleBasedStateMachine):
    """One bus on one backend; the rules are what users and handlers do to it."""

    backend: ClassVar[tuple[str, dict[str, Any]]] = ("asyncio", {})
    cancelled_elsewhere: ClassVar[Callable[[], Awaitable[None]]]

    def __init__(self) -> None:
        super().__init__()
        self._loop, self.portal = _start_loop(self.backend)
        self.stuck = False
        self.bus = Bus(workers=2)
        self.closed = False
        self.report: ShutdownReport | None = None
        # (stage name, envelope id) -> count; touched on the loop thread only
        self.admitted: Counter[tuple[str, str]] = Counter()
        self.acked: Counter[tuple[str, str]] = Counter()
        self.dead: Counter[tuple[str, str]] = Counter()
        self.pending = 0  # background publishes and replays not yet returned
        self.futures: list[concurrent.futures.Future[Receipt]] = []
        self.absorbed: set[int] = set()
        self.background: list[concurrent.futures.Future[None]] = []
        self.thread_gate = threading.Event()
        self.gate: anyio.Event = self._call(self._new_gate)
        self.stages: dict[str, tuple[int, Backpressure, Admission | None, bool]] = {}
        self._bus_cm: Any = None
        self.steps = 0

    # -- set-up and tear-down ---------------------------------------------------------

    @staticmethod
    async def _new_gate() -> anyio.Event:
        return anyio.Event()

    @initialize()
    def start(self) -> None:
        bus = self.bus
        record_add = bus.dead_letters.add

        def add(entry: DeadLetter) -> None:  # every dead letter, as it happens
            if entry.stage is not None and not entry.stage.startswith(DEADLETTER_STAGE):
                self.dead[(entry.stage, entry.envelope.id)] += 1
            record_add(entry)

        bus.dead_letters.add = add  # type: ignore[method-assign]
        self._bus_cm = self.portal.wrap_async_context_manager(bus)
        self._bus_cm.__enter__()

    def teardown(self) -> None:
        try:
            if not self.stuck:
                if not self.closed:
                    self._call(self._aclose, 0.05, None)
                self.thread_gate.set()
                self._call(self._open_gate)
                for future in self.background:
                    future.result(timeout=STEP_LIMIT)
                for threadsafe in self.futures:
                    threadsafe.exception(timeout=STEP_LIMIT)
                self._call(self._check, True)
        finally:
            self.thread_gate.set()
            if not self.stuck:  # (a stuck loop is left on its daemon thread)
                try:
                    if self._bus_cm is not None:
                        self._bus_cm.__exit__(None, None, None)
                finally:
                    self.portal.call(self.portal.stop)
                    self._loop.join(STEP_LIMIT)

    def _call(self, function: Callable[..., Any], *args: Any) -> Any:
        """Run ``function(*args)`` on the loop; a step that does not end is a deadlock."""
        future = self.portal.start_task_soon(_as_async(function), *args)
        try:
            return future.result(timeout=STEP_LIMIT)
        except concurrent.futures.TimeoutError:
            self.stuck = True
            raise AssertionError(f"deadlock: a step did not finish within {STEP_LIMIT} s") from None

    # -- handlers ---------------------------------------------------------------------

    def _recorder(self, stage: str) -> Callable[[Handler], Handler]:
        """Innermost-but-one layer: a handler that returned is acked right after."""

        @middleware
        async def record(env: Envelope, call_next: Handler) -> Any:
            result = await call_next(env)
            self.acked[(stage, env.id)] += 1
            return result

        return record

    async def _handle(self, env: Envelope) -> None:
        outcome = env.payload
        if outcome == "raise":
            raise ValueError("raise")
        if outcome == "reject":
            raise Reject("reject")
        if outcome in ("flaky", "cancel") and env.attempt == 1:
            if outcome == "cancel":
                await self.cancelled_elsewhere()
            raise ValueError("flaky")
        if outcome == "hang":
            await self.gate.wait()

    def _handle_sync(self, env: Envelope) -> None:
        outcome = env.payload
        if outcome == "raise" or (outcome in ("flaky", "cancel") and env.attempt == 1):
            raise ValueError(outcome)
        if outcome == "reject":
            raise Reject("reject")
        if outcome == "hang":
            self.thread_gate.wait(timeout=5)

    async def _announced(self, _: Envelope) -> None:
        return None

    # -- rules ------------------------------------------------------------------------

    @initialize(specs=st.lists(SUBSCRIPTIONS, min_size=1, max_size=4))
    def subscribe_some(self, specs: list[tuple[Any, ...]]) -> None:
        for spec in specs:
            self._call(self._subscribe, *spec)

    @precondition(lambda self: not self.closed)
    @rule(spec=SUBSCRIPTIONS)
    def subscribe(self, spec: tuple[Any, ...]) -> None:
        self._call(self._subscribe, *spec)

    async def _subscribe(
        self,
        pattern: str,
        group: str,
        concurrency: int,
        capacity: int,
        policy: Backpressure,
        attempts: int,
        timeout: float | None,
        offload: str | None,
        control: str | None,
    ) -> None:
        name = f"{pattern}@{group}"
        handler: Callable[..., Any]
        if pattern == "$deadletter":
            handler, offload, layers, control = self._announced, None, [], None
        else:
            handler = self._handle_sync if offload == "thread" else self._handle
            layers = [self._recorder(name)]
        admission = SHEDDING if control == "admission" else None
        adaptive = control == "adaptive"
        options = {
            "group": group,
            "concurrency": Adaptive(min=1, max=4) if adaptive else concurrency,
            "capacity": capacity,
            "backpressure": policy,
            "retry": Retry(max_attempts=attempts, backoff=0.001, jitter=False),
            "timeout": timeout,
            "offload": offload,
            "middleware": layers,
            "admission": admission,
        }
        known = self.stages.get(name)
        if known is not None:
            (capacity_was, policy_was, admission_was, controlled) = known
            if (capacity_was, policy_was, admission_was) != (capacity, policy, admission) or (
                adaptive and not controlled
            ):
                before = self.bus.statistics().stage(name).concurrency
                with pytest.raises(ConfigurationError):
                    self.bus.subscribe(pattern, handler, **options)
                assert self.bus.statistics().stage(name).concurrency == before
                return
        self.bus.subscribe(pattern, handler, **options)
        if known is None:
            self.stages[name] = (capacity, policy, admission, adaptive or admission is not None)

    @rule(
        topic=st.sampled_from(TOPICS),
        outcomes=BATCHES,
        timeout=st.sampled_from([0, 0.005, 0.02]),
    )
    def publish(self, topic: str, outcomes: list[str], timeout: float) -> None:
        for outcome in outcomes:
            self._call(self._publish, topic, outcome, timeout)

    async def _publish(self, topic: str, outcome: str, timeout: float | None) -> None:
        try:
            receipt = await self.bus.publish(topic, outcome, timeout=timeout)
        except PublishTimeout as error:
            assert not self.closed
            self._admit(error.receipt)
        except BusClosedError as error:
            if error.receipt is not None:
                self._admit(error.receipt)
        else:
            self._admit(receipt)

    @rule(topic=st.sampled_from(TOPICS), outcomes=BATCHES)
    def publish_in_the_background(self, topic: str, outcomes: list[str]) -> None:
        for outcome in outcomes:
            self.background.append(
                self.portal.start_task_soon(self._background_publish, topic, outcome)
            )

    async def _background_publish(self, topic: str, outcome: str) -> None:
        self.pending += 1
        try:
            await self._publish(topic, outcome, None)  # waits as long as it must
        finally:
            self.pending -= 1

    @rule(topic=st.sampled_from(TOPICS), outcomes=BATCHES)
    def publish_nowait(self, topic: str, outcomes: list[str]) -> None:
        for outcome in outcomes:
            self._call(self._publish_nowait, topic, outcome)

    async def _publish_nowait(self, topic: str, outcome: str) -> None:
        with contextlib.suppress(anyio.WouldBlock, BusClosedError):  # nothing admitted
            self._admit(self.bus.publish_nowait(topic, outcome))

    @rule(topic=st.sampled_from(TOPICS), outcomes=BATCHES, on_the_loop=st.booleans())
    def publish_threadsafe(self, topic: str, outcomes: list[str], on_the_loop: bool) -> None:
        for outcome in outcomes:
            if on_the_loop:
                future = self._call(self.bus.publish_threadsafe, topic, outcome)
            else:
                future = self.bus.publish_threadsafe(topic, outcome)
            self.futures.append(future)

    @rule(pick=st.integers(0, 10_000))
    def replay(self, pick: int) -> None:
        self.background.append(self.portal.start_task_soon(self._replay, pick))

    async def _replay(self, pick: int) -> None:
        entries = self.bus.dead_letters.list()
        ids = Counter(entry.envelope.id for entry in entries)
        # An id with one entry: what its replay admitted is known even when it fails.
        single = [entry.envelope.id for entry in entries if ids[entry.envelope.id] == 1]
        if not single:
            return
        id = single[pick % len(single)]
        self.pending += 1
        try:
            (receipt,) = await self.bus.dead_letters.replay(id)
        except KeyError:
            pass  # another replay of it is on its way
        except BusClosedError as error:
            if error.receipt is not None:
                self._admit(error.receipt)
        else:
            self._admit(receipt)
        finally:
            self.pending -= 1

    @rule(timeout=st.sampled_from([0, 0.005, 0.02]))
    def drain(self, timeout: float) -> None:
        self._call(self._drain, timeout)

    async def _drain(self, timeout: float) -> None:
        try:
            await self.bus.drain(timeout=timeout)
        except TimeoutError:
            assert not self.closed

    @rule()
    def release_hung_handlers(self) -> None:
        self.thread_gate.set()
        self.thread_gate = threading.Event()
        self._call(self._open_gate)

    async def _open_gate(self) -> None:
        self.gate.set()
        self.gate = anyio.Event()

    @precondition(lambda self: not self.closed and self.steps >= 4)
    @rule(
        timeout=st.sampled_from([0, 0.005, 0.02, 0.1]),
        cancel_after=st.sampled_from([None, None, 0.001]),
    )
    def aclose(self, timeout: float, cancel_after: float | None) -> None:
        self._call(self._aclose, timeout, cancel_after)

    async def _aclose(self, timeout: float, cancel_after: float | None) -> None:
        self.closed = True
        with anyio.move_on_after(cancel_after):
            self.report = await self.bus.aclose(timeout=timeout)
        with anyio.fail_after(10):
            # cancelled or not, a later call returns the one report, at once
            report = await self.bus.aclose(timeout=5)
        assert self.report is None or self.report is report
        self.report = report

    # -- the checks -------------------------------------------------------------------

    def _admit(self, receipt: Receipt) -> None:
        for name in (*receipt.accepted, *receipt.dropped):
            if not name.startswith(DEADLETTER_STAGE):
                self.admitted[(name, receipt.id)] += 1

    @invariant()
    def ledger_balances(self) -> None:
        self.steps += 1
        self._call(self._check, False)

    async def _check(self, final: bool) -> None:
        unresolved = False
        for index, future in enumerate(self.futures):
            if index in self.absorbed:
                continue
            if not future.done():
                unresolved = True
                continue
            self.absorbed.add(index)
            error = future.exception(timeout=0)
            if error is None:
                self._admit(future.result(timeout=0))
            elif isinstance(error, PublishTimeout | BusClosedError) and error.receipt is not None:
                self._admit(error.receipt)
            else:
                assert isinstance(error, BusClosedError), error
        stats = {stage.name: stage for stage in self.bus.statistics().stages}
        for stage in stats.values():
            ends = stage.acked + stage.dead_lettered + stage.abandoned
            assert stage.published == ends + stage.depth + stage.in_flight, stage
            if final:
                assert (stage.depth, stage.in_flight) == (0, 0), stage
            if stage.name.startswith(DEADLETTER_STAGE):
                continue
            # every ack and every dead letter the bus counted, the machine saw happen
            assert stage.acked == _total(self.acked, stage.name), stage
            assert stage.dead_lettered == _total(self.dead, stage.name), stage
        if (self.pending or unresolved) and not final:
            return  # admissions still on their way back to the machine
        assert not self.pending and not unresolved
        residue: dict[str, list[str]] = {name: [] for name in stats}
        for key in self.admitted.keys() | self.acked.keys() | self.dead.keys():
            name, id = key
            left = self.admitted[key] - self.acked[key] - self.dead[key]
            # each admission ends once: at most one copy is still in the stage
            assert left in (0, 1), (key, left)
            residue[name] += [id] * left
        for name, stage in stats.items():
            if name.startswith(DEADLETTER_STAGE):
                continue
            assert stage.published == _total(self.admitted, name), stage
            assert len(residue[name]) == stage.depth + stage.in_flight + stage.abandoned, stage
        if final:
            assert self.report is not None
            stats_abandoned = sum(stage.abandoned for stage in stats.values())
            assert len(self.report.abandoned) == stats_abandoned
            expected = Counter(id for ids in residue.values() for id in ids)
            listed = Counter(self.report.abandoned)
            assert not expected - listed, expected - listed
            announcements = sum(
                stage.abandoned
                for name, stage in stats.items()
                if name.startswith(DEADLETTER_STAGE)
            )
            assert (listed - expected).total() == announcements


def _start_loop(
    backend: tuple[str, dict[str, Any]],
) -> tuple[threading.Thread, anyio.from_thread.BlockingPortal]:
    """An event loop on ``backend`` in a daemon thread, and a portal into it.

    (A daemon thread, so a loop stuck in a deadlock never keeps the process alive.)
    """
    name, options = backend
    ready: queue.Queue[anyio.from_thread.BlockingPortal] = queue.Queue()

    async def serve() -> None:
        async with anyio.from_thread.BlockingPortal() as portal:
            ready.put(portal)
            await portal.sleep_until_stopped()

    thread = threading.Thread(
        target=anyio.run,
        args=(serve,),
        kwargs={"backend": name, "backend_options": options},
        name="state machine loop",
        daemon=True,
    )
    thread.start()
    return thread, ready.get(timeout=STEP_LIMIT)


def _as_async(function: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    async def call(*args: Any) -> Any:
        result = function(*args)
        if isinstance(result, Awaitable):
            return await result
        return result

    return call


def _total(counts: Counter[tuple[str, str]], stage: str) -> int:
    return sum(count for (name, _), count in counts.items() if name == stage)


def _run(
    backend: tuple[str, dict[str, Any]],
    cancelled_elsewhere: Callable[[], Awaitable[None]],
    examples: int,
    steps: int,
) -> None:
    machine = type(
        "BusMachine",
        (BusMachine,),
        {"backend": backend, "cancelled_elsewhere": staticmethod(cancelled_elsewhere)},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(120)
def test_every_envelope_ends_exactly_once_under_random_workloads(
    backend: tuple[str, dict[str, Any]],
    cancelled_elsewhere: Callable[[], Awaitable[None]],
) -> None:
    _run(backend, cancelled_elsewhere, examples=30, steps=25)


@pytest.mark.soak
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.timeout(3600)
def test_every_envelope_ends_exactly_once_under_long_random_workloads(
    backend: tuple[str, dict[str, Any]],
    cancelled_elsewhere: Callable[[], Awaitable[None]],
) -> None:
    _run(backend, cancelled_elsewhere, examples=1000, steps=60)
