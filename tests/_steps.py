"""The suite's steps: the slow kinds of test run last, each as a block of its own.

``pytest`` alone runs everything (the README's command, the one CI runs). Within that
run the tests marked ``chaos`` (process kills and cut connections against private
brokers), ``browser`` (the dashboard in a headless Chromium) and ``readme`` (each README
and guide block run as written in a subprocess) come after all the others, in that
order, and the summary says how many of each step passed, failed or skipped and how
long the step took: a slow or failing step shows as one.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

#: The steps after the main one, in the order they run.
LATER_STEPS = ("chaos", "browser", "readme")
MAIN_STEP = "main"


def step_of(item: pytest.Item) -> str:
    """The step ``item`` runs in: the first later step it is marked with, else the main one."""
    for step in LATER_STEPS:
        if item.get_closest_marker(step) is not None:
            return step
    return MAIN_STEP


def order(items: list[pytest.Item]) -> None:
    """Move each later step's tests after the main ones, keeping every step's own order."""
    rank = {MAIN_STEP: 0} | {step: n for n, step in enumerate(LATER_STEPS, start=1)}
    items.sort(key=lambda item: rank[step_of(item)])  # (stable: file order kept)


class StepTally:
    """Outcomes and seconds per step, from the run's reports."""

    def __init__(self) -> None:
        self.steps: dict[str, str] = {}
        self.outcomes: defaultdict[str, Counter[str]] = defaultdict(Counter)
        self.seconds: Counter[str] = Counter()

    def remember(self, items: list[pytest.Item]) -> None:
        """Note the step of every collected test."""
        self.steps = {item.nodeid: step_of(item) for item in items}

    def count(self, report: pytest.TestReport) -> None:
        """Add one phase's report (setup, call or teardown) to its test's step."""
        step = self.steps.get(report.nodeid, MAIN_STEP)
        self.seconds[step] += report.duration
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.outcomes[step][report.outcome] += 1
        elif report.when == "teardown" and report.failed:
            self.outcomes[step]["error"] += 1

    def lines(self) -> list[str]:
        """One line per step that ran: its outcomes and its time."""
        shown = []
        for step in (MAIN_STEP, *LATER_STEPS):
            if step not in self.outcomes:
                continue
            counts = ", ".join(f"{n} {what}" for what, n in sorted(self.outcomes[step].items()))
            shown.append(f"{step}: {counts} in {self.seconds[step]:.0f} s")
        return shown
