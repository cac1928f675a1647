"""Overload shedding by queue sojourn time, in the manner of CoDel.

A stage that cannot keep up grows a *standing queue*: envelopes wait longer and
longer, and every one handled late is work wasted on a caller that gave up. The
:class:`SojournShedder` tells a standing queue from a passing burst by how long the
oldest waiting envelope has waited, looked at on every pick-up:

* **Entering.** When that wait has stayed above ``target_wait`` for ``interval``
  seconds, the stage starts shedding. The oldest envelope tells since when without
  anyone watching: the queue has held an envelope older than the target at least since
  that envelope itself crossed the target (``now - (oldest_wait - target_wait)``), so
  the rule holds however rarely consumers pick up. A pick-up that finds the oldest
  under the target, or an empty queue, resets it. A burst that the stage works off
  within the interval never triggers it.
* **Shedding.** Before each pick-up, every queued envelope that has waited longer
  than ``target_wait`` is dead-lettered ``overload`` (never dropped silently), and
  the stage serves the newest envelope first (adaptive LIFO): under overload the
  freshest work is the work whose caller is still waiting.
* **Leaving.** When the queue is found empty, or nothing had to be shed for an
  ``interval`` while the oldest wait stayed under the target, the stage goes back to
  first-in first-out and sheds nothing.

The controller is pure and reads time from the clock it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum

from ._checks import check_number
from ._exceptions import ConfigurationError

__all__ = ["Admission", "Priority", "SojournShedder"]


class Priority(IntEnum):
    """Priority classes for ``publish(..., priority=)``, used by stages with admission control.

    A stage with ``admission=`` serves higher classes first; under overload the lower
    classes therefore wait longest and are shed first. Stages without admission
    control ignore the class (it travels as the ``asyncbus-priority`` header, along a
    routing slip too).
    """

    LOW = 0
    NORMAL = 1
    HIGH = 2


@dataclass(frozen=True, slots=True)
class Admission:
    """Shed load when a stage's queue stands: ``subscribe(..., admission=Admission())``.

    :param target_wait: seconds an envelope may wait in the queue once the stage is
        shedding; also the level the oldest wait must stay above to start shedding.
    :param interval: seconds the oldest wait must stay above ``target_wait`` before
        shedding starts, and without any shedding before it stops.
    :param lifo: serve the newest envelope first while shedding.
    :raises ConfigurationError: for a ``target_wait`` or ``interval`` that is not a
        positive finite number.
    """

    target_wait: float = 0.05
    interval: float = 0.1
    lifo: bool = True

    def __post_init__(self) -> None:
        for name in ("target_wait", "interval"):
            value = check_number(getattr(self, name), f"Admission: {name}", above=0)
            object.__setattr__(self, name, value)
        if not isinstance(self.lifo, bool):
            raise ConfigurationError(f"Admission: lifo must be a bool, got {self.lifo!r}")


class SojournShedder:
    """The shedding state of one stage (see the module docstring).

    :ivar shedding: whether the stage sheds stale envelopes and serves newest-first.
    :ivar episodes: how many times shedding started.
    """

    __slots__ = ("_above_since", "_last_shed", "episodes", "interval", "shedding", "target")

    def __init__(self, config: Admission) -> None:
        self.target = config.target_wait
        self.interval = config.interval
        self.shedding = False
        self.episodes = 0
        self._above_since: float | None = None
        self._last_shed = -math.inf

    def observe(self, oldest_wait: float, now: float) -> bool:
        """At a pick-up: the oldest queued envelope has waited ``oldest_wait`` seconds.

        :return: whether the stage sheds now.
        """
        if oldest_wait > self.target:
            if self._above_since is None:
                self._above_since = now - (oldest_wait - self.target)
            if not self.shedding and now - self._above_since >= self.interval:
                self.shedding = True
                self.episodes += 1
                self._last_shed = now
        else:
            self._above_since = None
            if self.shedding and now - self._last_shed >= self.interval:
                self.shedding = False
        return self.shedding

    def shed_before(self, now: float) -> float:
        """Envelopes admitted before this time have waited too long (while shedding)."""
        return now - self.target

    def note_shed(self, now: float) -> None:
        """Envelopes were shed at ``now``: shedding lasts at least another interval."""
        self._last_shed = now

    def idle(self) -> None:
        """The queue was found empty: the stage keeps up, whatever it did before."""
        self._above_since = None
        self.shedding = False
