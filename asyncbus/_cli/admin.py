"""``--admin HOST:PORT``: the admin app, ``/healthz`` and ``/readyz`` beside the worker.

The socket is bound before anything else starts (a port in use is a usage error, not
a crash after the bus started); with ``--workers N`` the supervisor binds it once and
hands it to worker 0, so the port stays bound while that worker restarts.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup

from .._bus import Bus
from . import CommandError, logger

__all__ = [
    "TOKEN_VARIABLE",
    "check_extras",
    "listen",
    "listening_socket",
    "parse_address",
    "serving",
    "start_uvicorn",
]


#: The environment variable whose value, when set, is the admin app's bearer token.
TOKEN_VARIABLE = "ASYNCBUS_ADMIN_TOKEN"
#: Seconds the admin server waits for open connections when it stops.
_CLOSE_CONNECTIONS = 2


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8080`` for IPv6; ``:8080`` for every interface) as a pair.

    :raises ValueError: with the reason, for argparse to show.
    """
    host, colon, port = text.rpartition(":")
    if not colon:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"the port of {text!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"the port of {text!r} is not from 0 to 65535")
    return host or "0.0.0.0", number


def check_extras(loop: str) -> None:
    """Refuse ``--admin`` early when it cannot work here.

    :raises CommandError: without Starlette or uvicorn, or on trio (uvicorn is asyncio).
    """
    missing = [name for name in ("starlette", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(
            f"--admin needs {' and '.join(missing)}: pip install 'asyncbus[starlette]' uvicorn"
        )
    if loop == "trio":
        raise CommandError("--admin serves with uvicorn, which needs --loop asyncio or uvloop")


def listen(address: str) -> socket.socket:
    """A listening TCP socket on ``address`` (``HOST:PORT``).

    :raises CommandError: when it cannot be bound (a port in use, an unknown host).
    """
    host, port = parse_address(address)
    try:
        return listening_socket(host, port)
    except OSError as error:
        raise CommandError(
            f"--admin cannot listen on {address}: {error.strerror or error}"
        ) from None


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (``SO_REUSEADDR``: a restart rebinds at once).

    :raises OSError: when it cannot be bound.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def _where(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def start_uvicorn(app: Any, listener: socket.socket, tasks: TaskGroup) -> tuple[Any, anyio.Event]:
    """Serve ``app`` on ``listener`` with uvicorn, in ``tasks``; signals are the caller's.

    Returns the ``uvicorn.Server`` (set its ``should_exit`` to stop it) and an event set
    once it has stopped. uvicorn leaves logging as it is (no ``log_config``), logs its
    own warnings and errors only, and no access line per request.
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=_CLOSE_CONNECTIONS,
    )
    server = uvicorn.Server(config)
    # uvicorn's own signal handlers would take SIGINT/SIGTERM from the caller (and raise
    # them again once it has stopped).
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    stopped = anyio.Event()

    async def serve() -> None:
        try:
            await server.serve(sockets=[listener])
        finally:
            stopped.set()

    tasks.start_soon(serve, name="asyncbus admin server")
    return server, stopped


@contextlib.asynccontextmanager
async def serving(
    bus: Bus, listener: socket.socket, tasks: TaskGroup, *, metrics: bool
) -> AsyncIterator[None]:
    """Serve ``admin_app(bus)`` on ``listener`` (uvicorn) until the block ends.

    The server keeps answering while the bus drains (``/readyz`` then says 503, and
    ``/healthz`` 200 "closing"); it stops when the block is left.
    """
    from ..integrations.starlette import admin_app

    app = admin_app(bus, token=os.environ.get(TOKEN_VARIABLE) or None, metrics=metrics)
    server, stopped = start_uvicorn(app, listener, tasks)
    logger.info("admin app, /healthz and /readyz on %s", _where(listener))
    try:
        yield
    finally:
        server.should_exit = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_CONNECTIONS + 1):
            await stopped.wait()
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_CONNECTIONS + 1):
            await stopped.wait()
