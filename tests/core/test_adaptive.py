"""The adaptive concurrency limit, stepped window by window with a fake clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from asyncbus import Adaptive, ConfigurationError
from asyncbus._adaptive import ConcurrencyLimit


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def window(limit: ConcurrencyLimit, clock: FakeClock, latency: float, in_flight: int) -> bool:
    """Feed one full window of ``latency`` samples; return whether the limit changed.

    Plenty of samples, in no time, then one after the window's length: enough for any
    window, whatever the limiter leaves out after a change.
    """
    for _ in range(63):
        assert not limit.record(latency, in_flight)
    clock.now += 1.0  # longer than any window
    return limit.record(latency, in_flight)


def test_limit_rises_while_latency_stays_at_its_floor() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64), clock)
    seen = [limit.limit]
    for _ in range(5):
        assert window(limit, clock, 0.010, limit.limit)
        seen.append(limit.limit)
    assert seen == [1, 2, 4, 8, 16, 32]  # slow start: doubling while the limit is used
    assert limit.no_load_latency == 0.010


def test_limit_falls_when_latency_rises_then_probes_one_step_at_a_time() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64), clock)
    for _ in range(4):
        window(limit, clock, 0.010, limit.limit)
    assert limit.limit == 16
    # Three times the floor, two windows running: the gradient (0.012 / 0.030 = 0.4)
    # is capped at halving.
    assert not window(limit, clock, 0.030, 16)
    assert window(limit, clock, 0.030, 16)
    assert limit.limit == 8
    # A little over the threshold (0.012): one step down, after two such windows running.
    assert not window(limit, clock, 0.0125, 8)
    assert window(limit, clock, 0.0125, 8)
    assert limit.limit == 7
    # Back at the floor: three windows of hold, then one step per window (no more doubling).
    changes = [window(limit, clock, 0.010, limit.limit) for _ in range(5)]
    assert changes == [False, False, False, True, True]
    assert limit.limit == 9


def test_an_unused_limit_is_never_raised() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=4, max=64), clock)
    for _ in range(10):
        assert not window(limit, clock, 0.010, 2)  # demand needs 2 of the 4
    assert limit.limit == 4
    # Slow start ended when the limit went unused: growth is one step now.
    assert window(limit, clock, 0.010, 4)
    assert limit.limit == 5


def test_limit_stays_within_min_and_max() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=2, max=5), clock)
    for _ in range(6):
        window(limit, clock, 0.010, limit.limit)
    assert limit.limit == 5
    for _ in range(6):
        window(limit, clock, 1.0, limit.limit)
    assert limit.limit == 2


def test_target_latency_is_the_threshold() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64, target_latency=0.050), clock)
    # Five times the floor, but under the target: still raised.
    window(limit, clock, 0.010, 1)
    assert window(limit, clock, 0.045, limit.limit)
    assert limit.limit == 4
    assert limit.threshold() == 0.050
    assert not window(limit, clock, 0.150, 4)  # three times the target ...
    assert window(limit, clock, 0.150, 4)  # ... twice running: halved
    assert limit.limit == 2


def test_a_window_needs_time_and_samples() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=8), clock)
    for _ in range(20):  # many samples, no time: the window stays open
        assert not limit.record(0.010, 1)
    clock.now += 0.019  # under the 20 ms minimum window
    assert not limit.record(0.010, 1)
    clock.now += 0.001
    assert limit.record(0.010, 1)
    assert limit.limit == 2


def test_broken_samples_are_ignored() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=8), clock)
    for bad in (math.nan, -1.0):
        for _ in range(10):
            assert not limit.record(bad, 1)
    clock.now += 1.0
    assert not limit.record(math.nan, 1)
    assert limit.limit == 1


@pytest.mark.parametrize(
    "arguments",
    [
        {"min": 0},
        {"min": 2, "max": 1},
        {"max": 0},
        {"min": True},
        {"min": 1.5},
        {"target_latency": 0},
        {"target_latency": -0.1},
        {"target_latency": math.nan},
        {"target_latency": math.inf},
        {"target_latency": "1"},
        {"target_latency": True},
    ],
)
def test_adaptive_rejects_what_cannot_work(arguments: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Adaptive(**arguments)  # type: ignore[arg-type]


def test_adaptive_is_a_frozen_slotted_dataclass() -> None:
    config = Adaptive()
    assert (config.min, config.max, config.target_latency) == (1, 256, None)
    assert not hasattr(config, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.min = 3  # type: ignore[misc]
    assert Adaptive(target_latency=1).target_latency == 1.0


def test_one_slow_window_alone_does_not_lower_the_limit() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64), clock)
    for _ in range(3):
        window(limit, clock, 0.010, limit.limit)
    assert limit.limit == 8
    assert not window(limit, clock, 0.015, 8)  # a noisy window ...
    assert not window(limit, clock, 0.010, 7)  # ... then normal again: forgotten
    assert not window(limit, clock, 0.100, 8)  # even a very slow one, alone
    assert limit.limit == 8


def test_samples_that_began_under_the_old_limit_are_left_out() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64), clock)
    window(limit, clock, 0.010, 1)
    window(limit, clock, 0.010, 2)
    assert limit.limit == 4
    # Two envelopes were in flight under the limit of 2: their samples do not count.
    clock.now += 1.0
    for _ in range(2):
        assert not limit.record(5.0, 4)
    for _ in range(7):
        assert not limit.record(0.010, 4)
    assert limit.record(0.010, 4)  # the eighth counted sample closes the window
    assert limit.limit == 8


def test_an_unused_limit_comes_down_towards_demand() -> None:
    clock = FakeClock()
    limit = ConcurrencyLimit(Adaptive(min=1, max=64), clock)
    for _ in range(5):
        window(limit, clock, 0.010, limit.limit)
    assert limit.limit == 32
    seen = []
    for _ in range(30):
        window(limit, clock, 0.010, 6)  # demand uses 6
        seen.append(limit.limit)
    # Down one step a window while more than a quarter (at least 2) stays unused.
    assert seen[:3] == [31, 30, 29]
    assert seen[-1] == 8
