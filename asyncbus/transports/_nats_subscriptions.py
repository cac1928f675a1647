"""The NATS transport's subscriptions: each one's pull consumer made, ended, woken.

``subscribe()`` makes (or updates) the group's durable consumer, subscribes a
:class:`~._nats_consumer.PullConsumer` to its private inbox and keeps it in
:class:`Subscriptions`. At the end, what was acked is written first; then a request
inbox's consumer is deleted (its process leaves), any other subscription gives back
what it held, and one whose pull request is still open on the server keeps its inbox
until the request ends (lingers). As the connection comes back, or closes, every
subscription is asked to pull again, or woken.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Protocol

import anyio

from .._routing import compile_pattern
from ._kit import TaskOwner
from ._kit.options import checked_prefetch
from ._kit.routes import is_inbox
from ._nats_client import broker_call
from ._nats_consumer import PullConsumer, PullHost

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext

    from ._nats_connection import NatsConnection
    from ._nats_streams import JetStreamSetup

__all__ = ["SubscribeHost", "Subscriptions"]

logger = logging.getLogger("asyncbus.transport.nats")


class SubscribeHost(PullHost, Protocol):
    """What subscribing uses of its transport (:class:`~.nats.NatsTransport`)."""

    inbox_ttl: float
    keep_alive: bool
    _tasks: TaskOwner
    _connection: NatsConnection
    _setup: JetStreamSetup

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connected client and its JetStream context."""
        ...


class Subscriptions:
    """The pull consumers of ``host``'s subscriptions (see the module docstring)."""

    def __init__(self, host: SubscribeHost) -> None:
        self._host = host
        #: The consumer of every subscription, and of those that ended but linger.
        self.consumers: set[PullConsumer] = set()

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, group: str, prefetch: int
    ) -> AsyncIterator[PullConsumer]:
        """Pull from the group's durable consumer; unsettled deliveries go back at the end."""
        host = self._host
        checked_prefetch(prefetch)
        nc, _ = host._client()
        name = await host._setup.ensure_consumer(pattern, group)
        consumer = PullConsumer(host, nc, name, pattern, group, prefetch)
        with broker_call(f"cannot subscribe to {consumer.inbox}"):
            subscription = await nc.subscribe(f"{consumer.inbox}.*", cb=consumer.on_message)
        self.consumers.add(consumer)
        try:
            if host.keep_alive:
                host._tasks.start_soon(consumer.keep_alive)
            yield consumer
        finally:
            with host.cleanup_scope():
                try:  # what was acked is written before the rest goes back
                    await host._acks.flush([consumer.name])
                except Exception as error:
                    logger.warning("NATS: acks of %s not written yet: %s", consumer.name, error)
                if is_inbox(group):
                    await self._drop_inbox(consumer, subscription)
                elif await consumer.release(subscription):
                    self.consumers.discard(consumer)
                else:
                    host._tasks.start_soon(self._linger, consumer, subscription)

    async def _linger(self, consumer: PullConsumer, subscription: Subscription) -> None:
        """Keep the inbox of a left subscription until its open pull request ended."""
        try:
            await consumer.linger(subscription)
        finally:
            self.consumers.discard(consumer)

    async def _drop_inbox(self, consumer: PullConsumer, subscription: Subscription) -> None:
        """Delete a leaving request inbox's consumer (what it holds is moot, its process
        leaves); a consumer left behind by a process that died goes after
        ``inbox_ttl`` without pulls (``inactive_threshold``)."""
        from nats.js.errors import NotFoundError

        host = self._host
        consumer.closed = True
        consumer.unsettled.clear()
        consumer.ready.clear()
        self.consumers.discard(consumer)
        try:
            with anyio.move_on_after(host.request_timeout):
                await consumer._unsubscribe(subscription)
                js = host._connection.js
                if not consumer.nc.is_closed and js is not None:
                    with contextlib.suppress(NotFoundError):
                        await js.delete_consumer(host.stream, consumer.name)
        except Exception as error:  # it expires anyway
            logger.warning(
                "NATS: deleting inbox consumer %s failed (it expires within %g s): %s",
                consumer.name,
                host.inbox_ttl,
                error,
            )

    def reach(self, topic: str) -> bool:
        """Whether a subscription of this process (not ended) takes ``topic``."""
        return any(
            compile_pattern(mine.pattern)(topic) for mine in self.consumers if not mine.closed
        )

    def pull_again(self) -> None:
        """The connection came back: every subscription asks again at once.

        The open pull requests may be gone: a restarted server forgot them, and the
        same server drops one whose inbox had no interest while we were away (then
        nothing answers it before its expiry). Ask again at once rather than wait for
        that: if the old request is still alive, it may bring up to one more batch,
        which waits in ``ready`` (kept in progress like the rest).
        """
        for consumer in list(self.consumers):
            if not consumer.closed:
                consumer.request = None
                consumer.pause_until = 0.0
                consumer.wake()

    def stop_lingering(self) -> None:
        """The transport is closing: the lingering ones stop waiting and unsubscribe now."""
        for consumer in list(self.consumers):
            if consumer.closed:
                consumer.request = None
                consumer.wake()

    def wake(self) -> None:
        """Every consumer looks again (the connection is closed)."""
        for consumer in list(self.consumers):
            consumer.wake()
