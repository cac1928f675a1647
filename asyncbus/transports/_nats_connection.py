"""The NATS transport's connection: opened, followed while it lasts, closed.

:class:`NatsConnection` holds the client, its JetStream context, the publisher on its
shared reply inbox (:mod:`._nats_publisher`) and what the server said of itself
(``max_payload``). Opening tries every URL within ``connect_timeout``, then has the
transport set up what it keeps on the server; whatever fails on the way (or a
cancellation) closes the connection again before :class:`ConnectError` is raised.
Once connected, nats-py reconnects for ever; the connection logs what happens and
tells the transport when it came back or closed. Acks written behind
(:class:`~._kit.AckWriter`) are written on it and count once the server confirmed them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from .._exceptions import ConfigurationError, ConnectError, TransportError
from ._kit import TaskOwner, require_asyncio
from ._nats_client import address, client_class, close_failed_attempt, confirm, server_id
from ._nats_publisher import JetStreamPublisher

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

__all__ = ["ConnectionHost", "NatsConnection"]

logger = logging.getLogger("asyncbus.transport.nats")

#: Seconds closing the connection may take (past the close deadline too: it is local).
_CLOSE_TIMEOUT = 0.5


class ConnectionHost(Protocol):
    """What the connection uses of its transport (:class:`~.nats.NatsTransport`)."""

    servers: list[str]
    prefix: str
    connect_timeout: float
    request_timeout: float
    publish_timeout: float
    reconnect_wait: float
    _tasks: TaskOwner

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        ...

    def cleanup_scope(self, timeout: float = math.inf) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded scope, bounded by ``timeout`` and the close deadline."""
        ...

    async def _set_up(
        self, nc: Client, js: JetStreamContext, publisher: JetStreamPublisher
    ) -> None:
        """Set up what the transport keeps on the server, once connected (its tasks open)."""
        ...

    def _reconnected(self) -> None:
        """The connection came back: what was announced meanwhile was missed."""
        ...

    def _closed(self) -> None:
        """The connection is closed for good."""
        ...


class NatsConnection:
    """The client of ``host`` and what lives as long as it (see the module docstring)."""

    def __init__(self, host: ConnectionHost) -> None:
        self._host = host
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.publisher: JetStreamPublisher | None = None
        #: The id of the server connected to (a restarted server has a new one).
        self.server: str | None = None
        #: The server's max_payload (read at connect).
        self.max_payload = 1 << 20
        #: What a broker call may raise (nats-py's errors are added once it is imported).
        self.errors: tuple[type[BaseException], ...] = (TimeoutError, OSError)

    def client(self) -> tuple[Client, JetStreamContext]:
        """The connected client and its JetStream context.

        :raises TransportError: when not connected.
        """
        if self.nc is None or self.js is None:
            raise TransportError("NatsTransport is not connected: use `async with transport:`")
        return self.nc, self.js

    def publishing(self) -> JetStreamPublisher:
        """The publisher of the connection.

        :raises TransportError: when not connected.
        """
        if self.publisher is None:
            raise TransportError("NatsTransport is not connected: use `async with transport:`")
        return self.publisher

    def where(self) -> str:
        """The server connected to now (the first listed before any connection)."""
        nc = self.nc
        connected = nc.connected_url if nc is not None else None
        if connected is not None:
            return f"{connected.hostname}:{connected.port}"
        return address(self._host.servers[0])

    async def open(self) -> None:
        """Connect, and have the transport set up what it keeps on the server.

        :raises ConnectError: when nats-py is missing, the server is unreachable or
            JetStream is not enabled on it.
        """
        host = self._host
        try:
            from nats.errors import Error as NatsError

            make_client = client_class()
        except ImportError as error:
            raise ConnectError(
                "NatsTransport needs the 'nats' extra: pip install 'asyncbus[nats]'"
            ) from error
        require_asyncio("NatsTransport", "nats-py")
        addresses = ", ".join(address(one) for one in host.servers)
        where = f"NATS at {addresses} ({host._shown()})"
        options: dict[str, Any] = {
            "name": f"asyncbus {host.prefix}",
            "connect_timeout": host.connect_timeout,
            # The first connection is tried twice (a refused one is retried once),
            # all within connect_timeout; once connected, reconnection never gives up
            # (set below).
            "allow_reconnect": True,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": host.reconnect_wait,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        self.errors = (NatsError, TimeoutError, OSError)
        nc = make_client()
        js = nc.jetstream(timeout=host.request_timeout)
        publisher = JetStreamPublisher(nc, host.publish_timeout)
        try:
            try:
                # nats-py gives each attempt connect_timeout; all of them get it together.
                with anyio.fail_after(host.connect_timeout):
                    await nc.connect(host.servers, **options)
            except Exception as error:
                reason = f"{type(error).__name__}: {error}"
                if isinstance(error, TimeoutError) and not str(error):
                    reason = f"no connection within connect_timeout={host.connect_timeout:g} s"
                raise ConnectError(f"NatsTransport cannot connect to {where}: {reason}") from error
            nc.options["max_reconnect_attempts"] = -1
            self.server = server_id(nc)
            await host._tasks.open()
            await host._set_up(nc, js, publisher)
        except BaseException as error:  # deliberate: close the connection on any way out
            try:
                # Outside any scope of its own: a task group's scope must be left where
                # it was entered (inside a new one, anyio raises RuntimeError).
                await host._tasks.aclose()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                    await publisher.stop()
                    if not nc.is_connected:
                        close_failed_attempt(nc)  # an attempt cut short keeps its socket
                    with contextlib.suppress(Exception):
                        await nc.close()
            if isinstance(error, ConnectError) or not isinstance(error, Exception):
                raise
            if isinstance(error, ConfigurationError):
                raise ConfigurationError(f"NatsTransport on {where}: {error}") from error
            raise ConnectError(
                f"NatsTransport on {where} cannot be set up: {type(error).__name__}: {error}"
                if not isinstance(error, TransportError)
                else f"NatsTransport on {where}: {error}"
            ) from error
        self.nc, self.js, self.publisher = nc, js, publisher
        self.max_payload = nc.max_payload

    def detach(self) -> tuple[Client, JetStreamPublisher | None] | None:
        """Forget the client (the transport is closing): it and its publisher, to be
        closed by :meth:`close` (``None``: not connected)."""
        nc, self.nc, self.js = self.nc, None, None
        publisher, self.publisher = self.publisher, None
        return None if nc is None else (nc, publisher)

    async def close(self, nc: Client, publisher: JetStreamPublisher | None) -> None:
        """Flush (by the deadline), stop the publisher and close ``nc`` (shielded)."""
        host = self._host
        with host.cleanup_scope():
            try:
                with anyio.move_on_after(host.request_timeout):
                    await nc.flush(timeout=host.request_timeout)  # type: ignore[arg-type]
            except Exception:
                logger.debug("flush before close failed", exc_info=True)
        with anyio.CancelScope(shield=True):
            if publisher is not None:
                await publisher.stop()
            # Closing the socket is local and quick; it runs even past the deadline,
            # bounded, so no connection is left open.
            with anyio.move_on_after(_CLOSE_TIMEOUT):
                try:
                    await nc.close()
                except Exception:
                    logger.debug("close failed", exc_info=True)

    async def write_acks(self, batch: dict[str, list[tuple[str, str | None]]]) -> list[str]:
        """``+ACK`` the queued deliveries (the AckWriter's ``write``): each one a message
        to its reply subject, buffered by nats-py and sent in one write.

        :returns: the consumers whose acks are lost for good (the connection is
            closed: the server delivers those messages again after ``ack_timeout``).
        """
        nc = self.nc
        if nc is None or nc.is_closed:
            return list(batch)
        publish = nc.publish
        reconnects = nc.stats["reconnects"]
        written: list[str] = []
        try:
            for name, acks in batch.items():
                for reply, _envelope_id in acks:
                    await publish(reply)
                written.append(name)
        except self.errors as error:
            # Closed meanwhile: the rest is lost (written again, an ack is harmless).
            logger.debug("NATS: writing acks failed: %s", error)
            return [name for name in batch if name not in written]
        await confirm(nc, reconnects, "writing acks", self._host.request_timeout)
        return []

    async def _on_error(self, error: Exception) -> None:
        nc = self.nc
        if nc is None:
            return  # connecting (open() reports it) or closing
        if nc.is_connecting or nc.is_reconnecting:  # an attempt to reconnect failed
            close_failed_attempt(nc)
        logger.warning("NATS %s: %s: %s", self.where(), type(error).__name__, error)

    async def _on_disconnected(self) -> None:
        if self.nc is None:
            return  # the transport's own aclose()
        logger.warning("NATS %s: disconnected, reconnecting", self.where())

    async def _on_reconnected(self) -> None:
        logger.info("NATS %s: reconnected", self.where())
        self.server = server_id(self.nc)
        if self.nc is not None:
            self.max_payload = self.nc.max_payload
        self._host._reconnected()

    async def _on_closed(self) -> None:
        self._host._closed()
