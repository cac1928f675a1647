"""Run every anyio test on asyncio, asyncio with uvloop, and trio."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
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


def _require_service(name: str, port: int) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
    except OSError as error:
        message = f"{name} not reachable on 127.0.0.1:{port} ({error})"
        if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; ASYNCBUS_REQUIRE_SERVICES=1 requires it", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def require_service() -> Callable[[str, int], None]:
    """``require_service(name, port)``: skip unless 127.0.0.1:port answers (CI: fail)."""
    return _require_service
