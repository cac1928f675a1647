"""Time on a mock clock: hours of delays and periodic schedules in milliseconds.

trio's ``MockClock(autojump_threshold=0)`` jumps to the next deadline whenever every
task waits, so each tick lands exactly; ``clock.jump(s)`` moves time on without running
anything meanwhile (an event loop that was blocked), which is how ticks get missed. The
bus reckons the wall clock from the loop's clock after its start, so these tests set
the wall clock the bus starts with, and a jump of the machine's clock later changes
nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from typing import Any
from zoneinfo import ZoneInfo

import anyio
import pytest

from asyncbus import Bus, ConfigurationError, Envelope, Schedule

pytestmark = [pytest.mark.anyio, pytest.mark.backends("trio-mock-clock")]

UTC = dt.UTC
BERLIN = ZoneInfo("Europe/Berlin")


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set the wall clock the bus reads when it starts: ``wall(datetime)``."""

    def set_wall(when: dt.datetime) -> None:
        epoch = when.timestamp()
        monkeypatch.setattr(time, "time", lambda: epoch)

    yield set_wall


def mock_clock(anyio_backend: tuple[str, dict[str, Any]]) -> Any:
    return anyio_backend[1]["clock"]


class Ticks:
    """The envelopes a periodic handler received, with the loop time of each."""

    def __init__(self) -> None:
        self.envelopes: list[Envelope] = []
        self.at: list[float] = []

    async def __call__(self, envelope: Envelope) -> None:
        self.envelopes.append(envelope)
        self.at.append(anyio.current_time())

    @property
    def local_times(self) -> list[str]:
        return [
            dt.datetime.fromisoformat(envelope.headers["asyncbus-tick"]).strftime("%d %H:%M%z")
            for envelope in self.envelopes
        ]


async def test_hours_of_delays_fire_exactly_when_due(wall: Any) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 0, tzinfo=UTC))
    fired: list[tuple[Any, float]] = []

    async def handle(envelope: Envelope) -> None:
        fired.append((envelope.payload, anyio.current_time()))

    bus = Bus()
    bus.subscribe("jobs", handle, group="g")
    with anyio.fail_after(10 * 3600):
        async with bus:
            began = anyio.current_time()
            await bus.publish("jobs", "in 3 h", delay=3 * 3600)
            await bus.publish("jobs", "at 14:00", at=dt.datetime(2026, 6, 1, 16, 0, tzinfo=BERLIN))
            await anyio.sleep(5 * 3600)
    assert [(payload, round(at - began, 3)) for payload, at in fired] == [
        ("at 14:00", 2 * 3600.0),
        ("in 3 h", 3 * 3600.0),
    ]


async def test_a_jump_of_the_machines_clock_fires_nothing_early(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fired: list[float] = []

    async def handle(n: int) -> None:
        fired.append(anyio.current_time())

    bus = Bus()
    bus.subscribe("jobs", handle, group="g")
    with anyio.fail_after(3 * 3600):
        async with bus:
            began = anyio.current_time()
            await bus.publish("jobs", 1, delay=3600)
            real = time.time
            monkeypatch.setattr(time, "time", lambda: real() + 86_400)  # NTP steps a day on
            await anyio.sleep(1800)
            assert fired == [] and len(bus.scheduled()) == 1
            await anyio.sleep(1801)
    assert [round(at - began) for at in fired] == [3600]


async def test_every_fires_each_tick_once_aligned_to_the_epoch(wall: Any) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 7, 30, tzinfo=UTC))
    ticks = Ticks()
    bus = Bus()
    bus.subscribe("reports", ticks, group="g")
    schedule = bus.schedule("reports", every=dt.timedelta(minutes=30), payload={"kind": "report"})
    assert isinstance(schedule, Schedule)
    with anyio.fail_after(24 * 3600):
        async with bus:
            await anyio.sleep(10 * 3600)
            statistics = bus.statistics().schedules
    assert len(ticks.envelopes) == 20
    assert ticks.local_times[:3] == ["01 12:30+0000", "01 13:00+0000", "01 13:30+0000"]
    assert [envelope.payload for envelope in ticks.envelopes] == [{"kind": "report"}] * 20
    ids = [envelope.id for envelope in ticks.envelopes]
    assert len(set(ids)) == 20
    first = dt.datetime(2026, 6, 1, 12, 30, tzinfo=UTC).timestamp()
    assert ids[0] == f"reports every 1800 s@{round(first * 1000)}"
    [stats] = statistics
    assert (stats.name, stats.fired, stats.last_outcome) == (
        "reports every 1800 s",
        20,
        "published",
    )
    assert stats.last_fire == dt.datetime(2026, 6, 1, 22, 0, tzinfo=UTC)
    assert stats.next_fire == dt.datetime(2026, 6, 1, 22, 30, tzinfo=UTC)


async def test_cron_follows_the_time_zone_across_the_spring_change(wall: Any) -> None:
    # Europe/Berlin, 29 March 2026: at 02:00 the clocks jump to 03:00.
    wall(dt.datetime(2026, 3, 28, 23, 0, tzinfo=BERLIN))
    nightly, hourly = Ticks(), Ticks()
    bus = Bus()
    bus.subscribe("nightly", nightly, group="n")
    bus.subscribe("hourly", hourly, group="h")
    bus.schedule("nightly", cron="30 2 * * *", timezone="Europe/Berlin")
    bus.schedule("hourly", cron="0 * * * *", timezone=BERLIN)
    with anyio.fail_after(3 * 24 * 3600):
        async with bus:
            await anyio.sleep(5 * 3600 - 1)  # until 04:59:59 CEST
    # 02:30 does not exist that night: cron fires it when the clocks jump over it
    assert nightly.local_times == ["29 03:00+0200"]
    assert hourly.local_times == [
        "29 00:00+0100",
        "29 01:00+0100",
        "29 03:00+0200",
        "29 04:00+0200",
    ]


async def test_cron_fires_a_repeated_hour_once_in_the_autumn(wall: Any) -> None:
    # Europe/Berlin, 25 October 2026: at 03:00 the clocks go back to 02:00.
    wall(dt.datetime(2026, 10, 25, 0, 0, 30, tzinfo=BERLIN))
    nightly = Ticks()
    bus = Bus()
    bus.subscribe("nightly", nightly, group="n")
    bus.schedule("nightly", cron="30 2 * * *", timezone="Europe/Berlin")
    with anyio.fail_after(3 * 24 * 3600):
        async with bus:
            await anyio.sleep(2 * 24 * 3600)
    assert nightly.local_times == ["25 02:30+0200", "26 02:30+0100"]


@pytest.mark.parametrize(("catch_up", "published"), [("skip", 0), ("one", 1), ("all", 6)])
async def test_missed_ticks_follow_catch_up(
    anyio_backend: tuple[str, dict[str, Any]], wall: Any, catch_up: str, published: int
) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 0, 1, tzinfo=UTC))
    ticks = Ticks()
    bus = Bus()
    bus.subscribe("t", ticks, group="g")
    bus.schedule("t", every=600, catch_up=catch_up)  # type: ignore[arg-type]
    with anyio.fail_after(24 * 3600):
        async with bus:
            await anyio.sleep(1200)  # 12:10 and 12:20 on time
            assert len(ticks.envelopes) == 2
            mock_clock(anyio_backend).jump(3600 + 300)  # the loop was stuck until 13:25
            await anyio.sleep(0)
            await anyio.sleep(300)  # and on to 13:30, a regular tick
            await bus.drain()
    times = ticks.local_times
    assert times[:2] == ["01 12:10+0000", "01 12:20+0000"]
    missed = ["01 12:30+0000", "01 12:40+0000", "01 12:50+0000", "01 13:00+0000"]
    missed += ["01 13:10+0000", "01 13:20+0000"]
    expected_late = {"skip": [], "one": missed[-1:], "all": missed}[catch_up]
    assert sorted(times[2:-1]) == expected_late
    assert times[-1] == "01 13:30+0000"
    assert len(times) == 3 + published


async def test_jitter_spreads_each_tick_within_its_bound(wall: Any) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 0, 0, 1, tzinfo=UTC))
    ticks = Ticks()
    bus = Bus()
    bus.subscribe("t", ticks, group="g")
    bus.schedule("t", every=60, jitter=dt.timedelta(seconds=10))
    with anyio.fail_after(24 * 3600):
        async with bus:
            began = anyio.current_time()
            await anyio.sleep(60 * 50 - 1)
    offsets = [(at - began) % 60 for at in ticks.at]
    assert len(offsets) == 49
    assert all(0 <= offset <= 10 for offset in offsets)
    assert len({round(offset, 6) for offset in offsets}) > 1  # spread, not one fixed delay


async def test_the_periodic_decorator_calls_its_handler_every_tick(wall: Any) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 0, 0, 1, tzinfo=UTC))
    calls: list[str] = []
    bus = Bus()

    @bus.periodic(every=dt.timedelta(hours=1), name="cleanup")
    async def cleanup(envelope: Envelope) -> None:
        calls.append(envelope.topic)

    assert callable(cleanup)
    with anyio.fail_after(24 * 3600):
        async with bus:
            await anyio.sleep(3 * 3600)
            [stats] = bus.statistics().schedules
    assert calls == ["periodic.cleanup"] * 3
    assert (stats.name, stats.topic, stats.fired) == ("cleanup", "periodic.cleanup", 3)


async def test_a_schedule_made_while_the_bus_runs_starts_at_its_next_tick(wall: Any) -> None:
    wall(dt.datetime(2026, 6, 1, 12, 0, 0, 1, tzinfo=UTC))
    ticks = Ticks()
    bus = Bus()
    bus.subscribe("t", ticks, group="g")
    with anyio.fail_after(24 * 3600):
        async with bus:
            await anyio.sleep(90)
            bus.schedule("t", every=60)
            await anyio.sleep(120)
    assert ticks.local_times == ["01 12:02+0000", "01 12:03+0000"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "every= or cron=, exactly one"),
        ({"every": 60, "cron": "* * * * *"}, "every= or cron=, exactly one"),
        ({"every": 0}, "every must be a finite number"),
        ({"every": dt.timedelta(seconds=-1)}, "every must be a finite number"),
        ({"cron": "61 * * * *"}, "cron='61 \\* \\* \\* \\*'"),
        ({"cron": "not cron"}, "cron='not cron'"),
        ({"cron": 5}, "cron must be a string"),
        ({"cron": "* * * * *", "timezone": "Mars/Olympus"}, "unknown time zone"),
        ({"every": 60, "jitter": -1}, "jitter must be a finite number"),
        ({"every": 60, "catch_up": "some"}, "catch_up must be one of"),
        ({"every": 60, "name": ""}, "name must be a non-empty string"),
    ],
)
async def test_a_bad_schedule_is_refused_at_once(options: dict[str, Any], message: str) -> None:
    bus = Bus()
    with pytest.raises(ConfigurationError, match=message):
        bus.schedule("t", **options)
    assert bus.statistics().schedules == ()


async def test_two_schedules_of_one_name_are_refused() -> None:
    bus = Bus()
    bus.schedule("t", every=60, name="same")
    with pytest.raises(ConfigurationError, match="named 'same' exists already"):
        bus.schedule("u", every=30, name="same")
