"""Run every anyio test on asyncio, asyncio with uvloop, and trio."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        pytest.param(
            ("asyncio", {"use_uvloop": True}),
            id="uvloop",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"
            ),
        ),
        pytest.param(("trio", {}), id="trio"),
    ],
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """The anyio backend (name, options) a test runs on."""
    backend: tuple[str, dict[str, Any]] = request.param
    return backend
