"""Integrations of asyncbus with frameworks, one module per framework.

Each module imports its framework, so none is imported by ``import asyncbus``:

* :mod:`asyncbus.integrations.starlette` (extra ``starlette``): run a bus in a
  Starlette or FastAPI lifespan, hand it to request handlers, and mount an admin
  API with a live dashboard, health probes and (optionally) Prometheus metrics.
* :mod:`asyncbus.integrations.opentelemetry` (extra ``otel``): trace every message
  end to end, across processes and brokers.
* :mod:`asyncbus.integrations.prometheus` (extra ``prometheus``): a Prometheus
  collector of a bus's statistics.
"""

from __future__ import annotations

__all__: list[str] = []
