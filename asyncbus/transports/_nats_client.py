"""nats-py as the NATS transport uses it: its errors, a confirmed write, its client's quirks.

nats-py's errors (and timeouts, socket errors) become :class:`TransportError` in
:func:`broker_call`; :func:`confirm` waits for a round trip, so that a write buffered
while the server is away is not taken for written; :func:`client_class` is nats-py's
client reconnecting where nats-py would close for good; the rest reads what nats-py
keeps private (a failed attempt's socket, the server's id).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .._exceptions import TransportError

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = [
    "address",
    "broker_call",
    "client_class",
    "close_failed_attempt",
    "confirm",
    "server_id",
]


@contextmanager
def broker_call(what: str) -> Iterator[None]:
    """Turn nats-py's errors (and timeouts, socket errors) into :class:`TransportError`."""
    from nats.errors import Error as NatsError

    try:
        yield
    except (NatsError, TimeoutError, OSError) as error:
        raise TransportError(f"{what}: {type(error).__name__}: {error}") from error


async def confirm(nc: Client, reconnects: int, doing: str, timeout: float) -> None:
    """Wait until the server has what was written on ``nc`` so far (one round trip).

    nats-py returns from a publish once the bytes are buffered, and buffers them
    while it is disconnected: without this, an ack, nak or term written to a broker
    that is down or silent would count as taken. Written before a reconnect
    (``reconnects``, nats-py's count then), the bytes may have died with the old
    socket, so they are not confirmed either.

    :raises TransportError: when the server did not answer within ``timeout`` (an
        ack is harmless to write again), or the connection was lost meanwhile.
    """
    if nc.is_connected:  # (while reconnecting, nats-py's flush sends no ping)
        with broker_call(f"NATS: {doing}: the server did not confirm"):
            await nc.flush(timeout=timeout)  # type: ignore[arg-type]
    if not nc.is_connected or nc.stats["reconnects"] != reconnects:
        raise TransportError(f"NATS: {doing}: the connection was lost before it was confirmed")


def address(url: str) -> str:
    """``host:port`` of a server URL (credentials and scheme left out)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        port = parts.port or 4222
    except ValueError:
        return parts.netloc.rpartition("@")[2]
    return f"{parts.hostname or '127.0.0.1'}:{port}"


@functools.cache
def client_class() -> type[Client]:
    """nats-py's client, reconnecting where nats-py would close for good.

    On an ``-ERR`` from the server, nats-py (up to 2.16 at least) closes the client
    unless the error is a permissions violation (reported, the connection goes on) or
    a stale connection (reconnected): no reconnection ever follows, so one command the
    server refused (a subject longer than its protocol line, say) ended every publish
    and pull of the process for good. The server closes the connection after such an
    error; this client takes it for a lost connection, as nats-py's own comment there
    suggests, and reconnects as after any other. While the first connection is being
    made, nats-py's handling stays (a refused login fails ``connect``).
    """
    from nats.aio.client import Client

    if not all(hasattr(Client, name) for name in ("_process_err", "_process_op_err")):
        return Client  # a nats-py whose internals changed: its own handling

    from nats.errors import Error as NatsError

    class ReconnectingClient(Client):
        async def _process_err(self, err_msg: str) -> None:
            message = err_msg.strip("'")
            lowered = message.lower()
            if (
                self.is_connecting
                or "permissions violation" in lowered
                or "stale connection" in lowered
            ):
                await super()._process_err(err_msg)
                return
            error = NatsError(f"nats: {message}")
            await self._error_cb(error)
            await self._process_op_err(error)

    return ReconnectingClient


def close_failed_attempt(nc: Client) -> None:
    """Close the socket of a reconnection attempt that failed after connecting.

    nats-py (up to 2.16 at least) leaves it open when the server accepted the
    connection but did not say hello (a proxy or load balancer in front of a server
    that is down), until the garbage collector finds it; every attempt leaks one.
    """
    transport = getattr(nc, "_transport", None)  # nats-py keeps it private
    close = getattr(transport, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


def server_id(nc: Client | None) -> str | None:
    """The id of the server ``nc`` is connected to (a restarted server has a new one)."""
    info = getattr(nc, "_server_info", None)  # nats-py keeps it private
    server = info.get("server_id") if isinstance(info, dict) else None
    return server if isinstance(server, str) else None
