"""Helpers for testing code that uses asyncbus.

* :func:`capture` records what a bus publishes, for assertions.
* The pytest plugin (:mod:`asyncbus.testing.pytest_plugin`, loaded automatically)
  provides a ``bus`` fixture for anyio and pytest-asyncio tests.
"""

from __future__ import annotations

from ._capture import Captured as Captured
from ._capture import Record as Record
from ._capture import capture as capture

__all__ = [
    "Captured",
    "Record",
    "capture",
]
