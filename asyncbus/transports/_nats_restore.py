"""Vanished state of the NATS transport: its streams and consumers made again.

A server restarted with its JetStream store lost, or a stream or consumer deleted by
another client: :meth:`Restorer.restore` makes the streams again, then this process's
consumers, one task at a time. Publishes of this process wait for it
(:meth:`Restorer.wait`): one stored before its consumers exist would reach none of them
(retention is by interest). Reading the groups finds a vanished stream too
(:meth:`Restorer.read_groups`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import anyio

from .._exceptions import TransportError
from ._nats_client import broker_call

if TYPE_CHECKING:
    from ._nats_connection import NatsConnection
    from ._nats_consumer import PullConsumer
    from ._nats_groups import GroupDirectory
    from ._nats_streams import JetStreamSetup
    from ._nats_subscriptions import Subscriptions

__all__ = ["RestoreHost", "Restorer"]

logger = logging.getLogger("asyncbus.transport.nats")


class RestoreHost(Protocol):
    """What restoring uses of its transport (:class:`~.nats.NatsTransport`)."""

    prefix: str
    stream: str
    publish_timeout: float
    _subscriptions: Subscriptions
    _groups: GroupDirectory


class Restorer:
    """Makes the streams and consumers of ``host`` again (see the module docstring).

    :param setup: what makes them.
    :param connection: the transport's connection.
    """

    def __init__(
        self, host: RestoreHost, setup: JetStreamSetup, connection: NatsConnection
    ) -> None:
        self._host = host
        self._setup = setup
        self._connection = connection
        self._lock = anyio.Lock()
        #: Times the streams and consumers were made again.
        self.restores = 0

    async def restore(self, consumer: PullConsumer | None = None) -> None:
        """Make the streams again if they are gone, then the consumers of the
        transport's subscriptions (``consumer`` first), so publishes are stored and
        reach the groups of this process again.

        One task at a time does it; the others wait for it and return.
        """
        generation = self.restores
        async with self._lock:
            if self.restores != generation and (consumer is None or consumer.failure is None):
                return  # made again meanwhile by another task
            _, js = self._connection.client()
            await self._setup.ensure_streams(js)
            others = [
                c for c in self._host._subscriptions.consumers if c is not consumer and not c.closed
            ]
            for each in ([consumer] if consumer is not None else []) + others:
                made = await self._setup.make_consumer(each.pattern, each.group)
                if each is not consumer and (made or each.failure is not None):
                    # Its open pull request was for the consumer that vanished.
                    each.failure = None
                    each.request = None
                    each.wake()
            self.restores += 1

    async def wait(self, subject: str, deadline: float) -> None:
        """Wait, until ``deadline`` (the publish's, anyio clock) at most, while another
        task makes the streams and consumers again (:meth:`restore`): a publish stored
        before this process's consumers exist would reach none of them (retention is by
        interest).

        :raises TransportError: when that is not done by ``deadline``.
        """
        if not self._lock.locked():
            return
        host = self._host
        with anyio.move_on_after(deadline - anyio.current_time()) as waited:
            async with self._lock:
                pass
        if waited.cancelled_caught:
            raise TransportError(
                f"publish to {subject} was not confirmed: the stream {host.stream} is "
                f"being made again (not done within {host.publish_timeout:g} s)"
            )

    async def read_groups(self) -> None:
        """Read the groups (the stream's consumers) again; make a vanished stream again."""
        from nats.js.errors import NotFoundError

        host = self._host
        _, js = self._connection.client()
        with broker_call(f"cannot list the consumers of stream {host.stream}"):
            try:
                await host._groups.read(js, host.prefix)
            except NotFoundError:
                # The server lost its state, or someone deleted the stream: make it
                # again with this process's consumers, then look.
                logger.warning("NATS: stream %s is gone; making it again", host.stream)
                await self.restore()
                await host._groups.read(js, host.prefix)
