"""Integrations of asyncbus with frameworks, one module per framework.

Each module imports its framework, so none is imported by ``import asyncbus``:

* :mod:`asyncbus.integrations.starlette` (extra ``starlette``): run a bus in a
  Starlette or FastAPI lifespan, hand it to request handlers, and mount an admin
  API with a live dashboard.
"""

from __future__ import annotations

__all__: list[str] = []
