"""Sojourn shedding and the priority lanes, stepped with explicit times."""

from __future__ import annotations

import dataclasses
import math

import pytest

from asyncbus import HEADER_PRIORITY, Admission, ConfigurationError, Envelope, Priority
from asyncbus._admission import SojournShedder
from asyncbus._lanes import Lanes, priority_of


def test_shedding_starts_when_the_oldest_wait_stays_above_target_for_an_interval() -> None:
    # Times are sums of powers of two, so every edge is exact.
    shedder = SojournShedder(Admission(target_wait=0.25, interval=0.5))
    assert not shedder.observe(0.25, now=10.0)  # at the target is not above it
    assert not shedder.observe(0.5, now=10.25)  # above since 10.0, the oldest tells
    assert not shedder.observe(0.625, now=10.375)
    assert shedder.observe(0.75, now=10.5)  # above for a whole interval
    assert shedder.episodes == 1
    assert shedder.shed_before(10.5) == 10.25


def test_a_queue_nobody_looked_at_sheds_at_the_first_pick_up() -> None:
    shedder = SojournShedder(Admission(target_wait=0.25, interval=0.5))
    # Consumers were busy for a second: the oldest crossed the target 0.75 s ago.
    assert shedder.observe(1.0, now=5.0)


def test_a_wait_under_the_target_resets_the_interval() -> None:
    shedder = SojournShedder(Admission(target_wait=0.25, interval=0.5))
    assert not shedder.observe(0.375, now=0.0)
    assert not shedder.observe(0.125, now=0.125)  # the queue caught up
    assert not shedder.observe(0.5, now=0.5)  # above since 0.25
    assert not shedder.observe(0.625, now=0.625)
    assert shedder.observe(0.75, now=0.75)


def test_an_empty_queue_resets_everything() -> None:
    shedder = SojournShedder(Admission(target_wait=0.25, interval=0.5))
    assert shedder.observe(1.0, now=0.0)
    shedder.idle()
    assert not shedder.shedding
    assert not shedder.observe(0.375, now=1.0)  # the interval starts again (at 0.875)
    assert shedder.observe(0.875, now=1.5)
    assert shedder.episodes == 2


def test_shedding_stops_after_an_interval_without_anything_to_shed() -> None:
    shedder = SojournShedder(Admission(target_wait=0.25, interval=0.5))
    assert shedder.observe(1.0, now=1.0)
    shedder.note_shed(1.0)
    assert shedder.observe(0.125, now=1.25)  # under the target, but shed 0.25 s ago
    assert shedder.observe(0.375, now=1.375)  # over the target again: still shedding
    shedder.note_shed(1.375)
    assert shedder.observe(0.125, now=1.75)
    assert not shedder.observe(0.125, now=1.875)
    assert not shedder.shedding


def envelope(number: int, priority: Priority | None = None) -> Envelope:
    headers = {} if priority is None else {HEADER_PRIORITY: str(int(priority))}
    return Envelope(topic="t", payload=number, headers=headers)


def test_lanes_serve_higher_classes_first_and_either_end_of_a_class() -> None:
    now = [0.0]
    lanes = Lanes(lambda: now[0])
    for number, priority in [
        (1, Priority.LOW),
        (2, None),
        (3, Priority.HIGH),
        (4, Priority.NORMAL),
        (5, Priority.HIGH),
        (6, Priority.LOW),
    ]:
        now[0] += 1.0
        lanes.push((0.0, envelope(number, priority)))
    assert len(lanes) == 6
    assert lanes.oldest_admitted() == 1.0
    order = [lanes.take(newest_first=True)[1].payload for _ in range(3)]
    order += [lanes.take()[1].payload for _ in range(3)]
    assert order == [5, 3, 4, 2, 1, 6]
    assert len(lanes) == 0
    with pytest.raises(IndexError):
        lanes.take()
    assert lanes.oldest_admitted() == math.inf


def test_lanes_give_up_stale_envelopes_lowest_class_first() -> None:
    now = [0.0]
    lanes = Lanes(lambda: now[0])
    for number, priority in [(1, Priority.HIGH), (2, Priority.LOW), (3, None), (4, Priority.LOW)]:
        now[0] += 1.0
        lanes.push((99.0, envelope(number, priority)))  # the lanes stamp it themselves
    assert [item.payload for item in lanes.take_stale(before=3.5)] == [2, 3, 1]
    assert len(lanes) == 1
    assert lanes.pop_oldest()[0] == 4.0


def test_unknown_priority_headers_count_as_normal() -> None:
    assert priority_of(envelope(1)) == Priority.NORMAL
    assert priority_of(Envelope(topic="t", headers={HEADER_PRIORITY: "9"})) == Priority.NORMAL
    assert priority_of(envelope(1, Priority.LOW)) == Priority.LOW


@pytest.mark.parametrize(
    "arguments",
    [
        {"target_wait": 0},
        {"target_wait": -1.0},
        {"target_wait": math.nan},
        {"target_wait": math.inf},
        {"interval": 0.0},
        {"interval": math.nan},
        {"interval": -math.inf},
        {"interval": "0.1"},
        {"target_wait": True},
        {"lifo": "yes"},
    ],
)
def test_admission_rejects_what_cannot_work(arguments: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        Admission(**arguments)  # type: ignore[arg-type]


def test_admission_is_a_frozen_slotted_dataclass() -> None:
    config = Admission()
    assert (config.target_wait, config.interval, config.lifo) == (0.05, 0.1, True)
    assert not hasattr(config, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.interval = 1.0  # type: ignore[misc]
    assert Admission(target_wait=1, interval=2) == Admission(target_wait=1.0, interval=2.0)
