"""Adaptive concurrency: a stage's consumer count follows its handler's latency.

The controller is pure: it is fed one latency sample per handled envelope and reads
time only from the clock it was given, so tests step it with a fake clock.

The rule, in the family of TCP Vegas and gradient limiters:

* Samples are grouped in windows (at least ``_MIN_WINDOW`` seconds, five no-load
  latencies and two of the last window's median latency long, so most of a window's
  samples started under the current limit; at least ``_MIN_SAMPLES`` samples, at most
  ``_MAX_SAMPLES``). After the limit changes, as many samples as envelopes were in
  flight under the old limit are left out: they describe the old limit, not the new.
  A window's figure is the median of its samples, so a few slow outliers (a noisy
  machine, one slow call) do not move the limit.
* The *no-load latency* is the smallest window median seen over the last two epochs
  of ``_EPOCH`` windows: a sliding minimum, so a downstream that got slower for good
  is re-learnt instead of being chased forever.
* The *threshold* is ``target_latency`` when given, else the no-load latency times
  ``_TOLERANCE``: latency near its floor means the downstream has spare parallelism;
  latency above it means callers queue inside the downstream (its knee is passed).
* Median at or under the threshold, and the limit was used (the window's peak
  in-flight reached the limit): raise it, doubling until the first back-off or the
  first window that left the limit unused (slow start), then by one per window, and
  only ``_HOLD`` windows after the last back-off (so a limit one above the knee is
  visited briefly, not every other window). An unused limit is never raised, so a
  lightly loaded stage does not drift to ``max``; a limit that stays well above what
  demand used (by more than a quarter, at least 2) comes down one step per window, so
  the next burst starts near the knee instead of far past it.
* Median over the threshold in two windows running (one slow window alone may be a
  stalled event loop on a busy machine, not the downstream): lower the limit by one,
  since a knee is sharp and one caller too many already shows; when the median is
  over twice the threshold, multiply the limit by ``threshold / median`` instead, at
  most halving it (the gradient back to where latency was acceptable, for a limit far
  past the knee).
* The limit always stays within ``[min, max]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ._checks import check_count, check_number
from ._exceptions import ConfigurationError

__all__ = ["Adaptive", "ConcurrencyLimit"]

#: A window is at least this long (seconds) ...
_MIN_WINDOW = 0.02
#: ... and this many no-load latencies ...
_WINDOW_LATENCIES = 5.0
#: ... and holds at least this many samples; it closes early at _MAX_SAMPLES.
_MIN_SAMPLES = 8
_MAX_SAMPLES = 512
#: Latency up to this multiple of the no-load latency counts as "no queueing downstream".
_TOLERANCE = 1.2
#: Windows to wait after a back-off before probing upwards again.
_HOLD = 3
#: Windows over the threshold in a row before a one-step back-off.
_PATIENCE = 2
#: Unused consumers a limit keeps (or a quarter of it, if more) before it comes down.
_SPARE = 2
#: Windows per epoch of the sliding no-load minimum.
_EPOCH = 100
#: A back-off never cuts the limit by more than this factor in one window.
_MAX_CUT = 0.5


@dataclass(frozen=True, slots=True)
class Adaptive:
    """Let a stage find its own concurrency: ``subscribe(..., concurrency=Adaptive())``.

    The stage starts ``min`` consumers and raises the count while handling latency
    stays near its no-load minimum (or under ``target_latency``), and lowers it when
    latency rises: it finds the knee of the downstream its handler calls. Consumers
    are added and retired live, always between envelopes.

    :param min: fewest consumers (>= 1).
    :param max: most consumers (>= ``min``).
    :param target_latency: seconds of handling latency to hold; ``None`` (the default)
        tolerates 1.2 times the no-load latency the controller measures.
    :raises ConfigurationError: for ``min < 1``, ``max < min``, or a ``target_latency``
        that is not a positive finite number.
    """

    min: int = 1
    max: int = 256
    target_latency: float | None = None

    def __post_init__(self) -> None:
        for name in ("min", "max"):
            check_count(getattr(self, name), f"Adaptive: {name}", 1)
        if self.max < self.min:
            raise ConfigurationError(
                f"Adaptive: max must be >= min, got min={self.min!r}, max={self.max!r}"
            )
        target = self.target_latency
        if target is not None:
            target = check_number(target, "Adaptive: target_latency (or None)", above=0)
            object.__setattr__(self, "target_latency", target)


class ConcurrencyLimit:
    """The limit controller of one adaptive subscription (see the module docstring).

    :param config: the subscription's :class:`Adaptive`.
    :param clock: seconds, monotonic (the stage passes ``anyio.current_time``).
    """

    __slots__ = (
        "_baseline",
        "_clock",
        "_epoch_min",
        "_epoch_windows",
        "_hold",
        "_last_median",
        "_over",
        "_previous_min",
        "_samples",
        "_skip",
        "_slow_start",
        "_target",
        "_window_peak",
        "_window_start",
        "limit",
        "maximum",
        "minimum",
    )

    def __init__(self, config: Adaptive, clock: Callable[[], float]) -> None:
        self.minimum = config.min
        self.maximum = config.max
        #: How many consumers the stage should run now.
        self.limit = config.min
        self._target = config.target_latency
        self._clock = clock
        self._samples: list[float] = []
        self._window_start: float | None = None  # the clock is first read at the first sample
        self._window_peak = 0
        self._slow_start = True
        self._baseline = math.inf
        self._epoch_min = math.inf
        self._previous_min = math.inf
        self._epoch_windows = 0
        self._last_median = 0.0
        self._hold = 0
        self._over = 0
        self._skip = 0

    @property
    def no_load_latency(self) -> float:
        """The smallest recent window median, in seconds (``inf`` before the first window)."""
        return self._baseline

    def threshold(self) -> float:
        """Latency above which the limit comes down (``inf`` until something is measured)."""
        if self._target is not None:
            return self._target
        return self._baseline * _TOLERANCE

    def record(self, latency: float, in_flight: int) -> bool:
        """Add one handled envelope's latency; return whether :attr:`limit` changed.

        :param latency: seconds from pick-up to settlement.
        :param in_flight: envelopes the subscription was handling when this one started
            (itself included).
        """
        if not latency >= 0.0:  # NaN or negative: a broken clock; ignore the sample
            return False
        if self._skip:
            self._skip -= 1  # began under the previous limit
            return False
        self._samples.append(latency)
        if self._window_start is None:
            self._window_start = self._clock()
        if in_flight > self._window_peak:
            self._window_peak = in_flight
        samples = len(self._samples)
        if samples < _MIN_SAMPLES:
            return False
        now = self._clock()
        floor = self._baseline if math.isfinite(self._baseline) else 0.0
        window = max(_MIN_WINDOW, _WINDOW_LATENCIES * floor, 2.0 * self._last_median)
        assert self._window_start is not None
        if now - self._window_start < window and samples < _MAX_SAMPLES:
            return False
        return self._close_window(now)

    def _close_window(self, now: float) -> bool:
        samples = self._samples
        samples.sort()
        median = samples[len(samples) // 2]
        peak = self._window_peak
        self._samples = []
        self._window_start = now
        self._window_peak = 0
        self._learn_floor(median)
        self._last_median = median
        before = self.limit
        threshold = self.threshold()
        if median <= threshold:
            self._over = 0
            if self._hold:
                self._hold -= 1
            elif peak >= self.limit:
                grown = self.limit * 2 if self._slow_start else self.limit + 1
                self.limit = min(self.maximum, grown)
            else:
                # Demand, not the downstream, bounds the stage now: from here on probe
                # one step at a time, so a burst does not double the limit past the knee,
                # and let an unused limit come down towards what demand used.
                self._slow_start = False
                if self.limit - peak > max(_SPARE, self.limit // 4):
                    self.limit = max(self.minimum, self.limit - 1)
        else:
            self._over += 1
            severe = median > 2.0 * threshold
            if self._over >= _PATIENCE:
                self._over = 0
                self._slow_start = False
                self._hold = _HOLD
                lowered = self.limit - 1
                if severe:
                    cut = max(_MAX_CUT, threshold / median)
                    lowered = min(lowered, math.floor(self.limit * cut))
                self.limit = max(self.minimum, lowered)
        if self.limit != before:
            self._skip = before
        return self.limit != before

    def _learn_floor(self, median: float) -> None:
        self._epoch_min = min(self._epoch_min, median)
        self._epoch_windows += 1
        if self._epoch_windows >= _EPOCH:
            self._previous_min, self._epoch_min = self._epoch_min, math.inf
            self._epoch_windows = 0
        self._baseline = min(self._previous_min, self._epoch_min)
