"""Private broker servers for crash and restart tests: never the shared services.

A test that kills, restarts or wipes a broker starts its own on a free loopback port,
with its files in a temporary directory of the test::

    async with private_redis(tmp_path) as server:
        url = server.url
        await server.restart(fresh=True)   # kill -9, wipe its files, start again

The process is started by the test and only that process is ever killed. When the
server binary is missing the test is skipped, or fails under
``ASYNCBUS_REQUIRE_SERVICES=1`` (CI), like the shared brokers' fixtures.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import pytest

__all__ = ["PrivateServer", "free_port", "private_nats", "private_redis"]

#: Seconds a server may take to accept connections after it was started.
START_TIMEOUT = 15.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _binary(name: str, *fallbacks: str) -> str:
    found = shutil.which(name) or next((f for f in fallbacks if os.path.exists(f)), None)
    if found is None:
        message = f"{name} is not installed"
        if os.environ.get("ASYNCBUS_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{message}; ASYNCBUS_REQUIRE_SERVICES=1 requires it", pytrace=False)
        pytest.skip(message)
    return found


class PrivateServer:
    """One broker server process of a test, on its own port and data directory.

    :param command: the command line for a port and a data directory.
    :param scheme: the URL scheme clients use.
    """

    def __init__(
        self, command: Callable[[int, Path], list[str]], scheme: str, directory: Path
    ) -> None:
        self._command = command
        self.port = free_port()
        self.directory = directory
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self._process: anyio.abc.Process | None = None

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        assert not self.running, "the server is already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self._process = await anyio.open_process(
            self._command(self.port, self.directory),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with anyio.fail_after(START_TIMEOUT):
            while True:
                if self._process.returncode is not None:
                    raise RuntimeError(f"{self._command(self.port, self.directory)[0]} exited")
                try:
                    stream = await anyio.connect_tcp("127.0.0.1", self.port)
                except OSError:
                    await anyio.sleep(0.05)
                else:
                    await stream.aclose()
                    return

    async def kill(self) -> None:
        """``kill -9`` the server (only this test's process) and reap it."""
        process, self._process = self._process, None
        if process is None:
            return
        with anyio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGKILL)
            await process.wait()
            await process.aclose()

    async def restart(self, *, fresh: bool = False) -> None:
        """Kill the server and start it again on the same port; ``fresh``: with its
        data directory emptied first (a server that lost its state)."""
        await self.kill()
        if fresh:
            shutil.rmtree(self.directory, ignore_errors=True)
        await self.start()


def _redis_command(port: int, directory: Path) -> list[str]:
    return [
        _binary("redis-server"),
        *("--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory)),
        *("--save", "", "--appendonly", "no"),
    ]


def _nats_command(port: int, directory: Path) -> list[str]:
    return [
        _binary("nats-server", "/usr/sbin/nats-server"),
        *("-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(directory)),
    ]


@asynccontextmanager
async def _private(
    command: Callable[[int, Path], list[str]], scheme: str, directory: Path
) -> AsyncIterator[PrivateServer]:
    command(0, directory)  # skips (or fails) now when the binary is missing
    server = PrivateServer(command, scheme, directory)
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


def private_redis(directory: Path) -> AbstractAsyncContextManager[PrivateServer]:
    """A redis-server of the test's own, without persistence (a restart loses all)."""
    return _private(_redis_command, "redis", directory / "redis")


def private_nats(directory: Path) -> AbstractAsyncContextManager[PrivateServer]:
    """A nats-server of the test's own with JetStream, its store in ``directory``."""
    return _private(_nats_command, "nats", directory / "nats")
