"""Counting the event loop's turns around an operation: the fairness tests' helpers."""

from __future__ import annotations

import anyio
import anyio.lowlevel


async def ticker(events: list[str], stop: anyio.Event) -> None:
    """Another task: one "tick" per turn of the event loop until ``stop``."""
    while not stop.is_set():
        events.append("tick")
        await anyio.lowlevel.checkpoint()


def run_lengths(events: list[str], name: str) -> list[int]:
    """Lengths of the runs of ``name`` in ``events`` (other entries separate runs)."""
    marks = "".join("x" if event == name else " " for event in events)
    return [len(run) for run in marks.split()]
