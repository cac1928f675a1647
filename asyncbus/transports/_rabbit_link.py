"""The RabbitMQ transport's connections: one generation of them (a :class:`Link`), opened
on the first node that answers, reopened when lost, and the calls on it retried across
that (:class:`Connections`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from .._exceptions import ConfigurationError, ConnectError, TransportError
from .._failures import describe_error
from ._kit import Backoff, redact, require_asyncio
from ._rabbit_channel import retrieve, spurious_cancel
from ._rabbit_consumer import BACKOFF_MIN, LOST, RELEASE_TIMEOUT, Subscription

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection
    from pamqp.commands import Basic

    from ._kit import TaskOwner

__all__ = ["EXTRA_MISSING", "Connections", "Link", "LinkHost"]

logger = logging.getLogger("asyncbus.transport.rabbit")

T = TypeVar("T")

EXTRA_MISSING = "RabbitTransport needs the 'rabbit' extra: pip install 'asyncbus[rabbit]'"
#: Seconds a close whose deadline has passed still runs: enough for the client to
#: begin it and then cut it short (a close never begun leaves its socket open).
_CLOSE_CUT = 0.01


class Link:
    """One generation of connections (publishing, consuming) and the shared channels."""

    def __init__(
        self,
        publisher: AbstractConnection,
        consumer: AbstractConnection,
        channel: AbstractChannel,
        on_lost: Callable[[Link], None],
    ) -> None:
        self.publisher = publisher
        self.consumer = consumer
        #: Publishes, with confirms (reopened when the broker closed it).
        self.channel = channel
        self.channel_lock = anyio.Lock()
        #: Declarations and counts, one at a time (a failed one closes the channel).
        self.admin: AbstractChannel | None = None
        self.admin_lock = anyio.Lock()
        #: Queues declared and bound on this link.
        self.declared: set[str] = set()
        #: Queues recorded in the catalog, and groups announced, on this link: again on
        #: every new link, since a broker that restarted may have lost both records.
        self.catalogued: set[str] = set()
        self.announced: set[str] = set()
        #: The channel consuming the news of groups (closed with the connection).
        self.news: AbstractChannel | None = None
        self.lost = anyio.Event()
        self._on_lost = on_lost

    def watch(self) -> None:
        """Set :attr:`lost` (and tell ``on_lost``) once either connection closes."""
        for connection in (self.publisher, self.consumer):
            connection.closing.add_done_callback(self._closed)

    def _closed(self, future: asyncio.Future[Any]) -> None:
        retrieve(future)
        if not self.lost.is_set():
            self.lost.set()
            self._on_lost(self)

    async def reopen_channel(self) -> AbstractChannel:
        """The publishing channel, opened again (by the first who asks) after the broker
        closed it."""
        async with self.channel_lock:
            if self.channel.is_closed:
                self.channel = await self.publisher.channel(publisher_confirms=True)
        return self.channel

    async def renew_channel(self, refused: AbstractChannel) -> None:
        """Close the publishing channel ``refused`` (the broker nacked a publish on it)
        unless it was replaced already: the next publish opens a fresh one.

        A channel keeps what it learnt of a quorum queue: one whose first publish found
        the queue's leader gone (its node just died) is refused on that channel until
        the channel closes, however soon a new leader is elected.
        """
        async with self.channel_lock:
            if self.channel is not refused or refused.is_closed:
                return
            try:
                with anyio.move_on_after(RELEASE_TIMEOUT):
                    await refused.close()
            except Exception as error:  # closing what is already broken
                logger.debug("RabbitMQ: closing a refused channel failed: %r", error)

    async def close(self, timeout: float = RELEASE_TIMEOUT) -> None:
        """Close both connections, together and shielded, within ``timeout`` seconds.

        A broker that does not answer the close in time is not waited for: the client
        cuts its close handshake short and closes the socket itself (which takes a
        moment, not a round trip), so no socket outlives the call.
        """
        # The client's own timeout, not a cancel scope: cancelled from outside before it
        # starts, a close would leave the connection open; timed out, it closes it.
        timeout = max(timeout, _CLOSE_CUT)

        async def close(connection: AbstractConnection) -> None:
            try:
                # (aiormq's Base.close takes the timeout; its abstract class omits it.)
                await connection.close(timeout=timeout)  # type: ignore[call-arg]
            except Exception as error:  # timed out, or closing what is already broken
                logger.debug("RabbitMQ: closing a connection failed: %r", error)

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as closing:
                for connection in (self.consumer, self.publisher):
                    closing.start_soon(close, connection)


class LinkHost(Protocol):
    """What the connections use of their transport (:class:`~.rabbit.RabbitTransport`)."""

    #: Every URL given, and the one in use (set here: the last one connected to).
    servers: list[str]
    url: str
    prefix: str
    publish_timeout: float
    connect_timeout: float
    max_backoff: float
    _tasks: TaskOwner
    _subscriptions: set[Subscription]

    async def _set_up(self, link: Link) -> None:
        """Declare on a new link what every link needs, and read what the broker records."""
        ...

    def _link_lost(self, link: Link) -> None:
        """The connections of ``link`` closed: what lived on them is gone."""
        ...


class Connections:
    """The transport's link to the broker: opened on the first node that answers, in turn
    from the one used last; watched, and reopened with exponential, jittered backoff
    whenever it drops; calls on it retried across that, up to ``publish_timeout``."""

    def __init__(self, host: LinkHost) -> None:
        self._host = host
        #: The current link (``None`` before the first connect and after the close).
        self.link: Link | None = None
        #: Set while the link is live (or the transport closing): what waits for a link
        #: waits for it.
        self.event = anyio.Event()
        self.closing = False
        #: The client (aiormq), once loaded by :meth:`load`.
        self.aiormq: Any = None
        #: What the client raises when the broker refused (or an argument is wrong): not
        #: retried; when a queue does not exist; when a ``mandatory`` publish came back;
        #: when the broker nacked a publish (retried on a fresh channel).
        self.fatal: tuple[type[BaseException], ...] = ()
        self.not_found: type[BaseException] = LookupError
        self.returned: type[BaseException] = LookupError
        self.nacked: type[BaseException] = LookupError

    def load(self) -> type[Basic.Properties]:
        """Import the client and learn its errors; return its message properties class.

        :raises ConnectError: when aio-pika is missing.
        :raises TransportError: when not running on asyncio.
        """
        try:
            import aio_pika  # noqa: F401  (the extra; its AMQP layer does the work)
            import aiormq
            import aiormq.exceptions as errors
            from pamqp.commands import Basic
        except ImportError as error:
            raise ConnectError(EXTRA_MISSING) from error
        require_asyncio("RabbitTransport", "aiormq")
        self.aiormq = aiormq
        # The client may fail a call on a closing connection with anything (a future
        # rejected with a bare Exception): all but these (the broker refused, or an
        # argument is wrong) is taken for a lost connection and retried until
        # publish_timeout.
        self.fatal = (
            errors.ChannelAccessRefused,
            errors.ChannelNotFoundEntity,
            errors.ChannelLockedResource,
            errors.ChannelPreconditionFailed,
            errors.AuthenticationError,
            errors.ProbableAuthenticationError,
            errors.IncompatibleProtocolError,
            ValueError,
            TypeError,
        )
        self.not_found = errors.ChannelNotFoundEntity
        self.returned = errors.PublishError
        # A nack: the message is not stored (a quorum queue without a leader for a moment,
        # or a channel that still refuses after one was elected): sent again, on a fresh
        # channel, until publish_timeout.
        self.nacked = errors.DeliveryError
        return Basic.Properties

    async def open(self) -> None:
        """Connect, and make the new link the live one.

        :raises ConnectError: when no node could be reached.
        """
        self.closing = False
        try:
            link = await self._open_link()
        except Exception as error:
            reason = str(error) or type(error).__name__
            raise ConnectError(
                f"cannot connect to RabbitMQ at {redact(self._host.url)}: {reason}"
            ) from error
        self.link = link
        self.event = anyio.Event()
        self.event.set()

    def stop(self) -> None:
        """The transport is closing: whoever waits for a link wakes up and sees it."""
        self.closing = True
        self.event.set()

    async def close(self, timeout: float) -> None:
        """Close the link, if there is one, within ``timeout`` seconds (:meth:`Link.close`)."""
        link, self.link = self.link, None
        if link is not None:
            await link.close(timeout)

    async def _open_link(self) -> Link:
        """Open a link to the first node that answers, from the one used last.

        :raises Exception: what the last node tried raised (each is logged).
        """
        host = self._host
        start = host.servers.index(host.url)
        order = host.servers[start:] + host.servers[:start]
        *others, last = order
        for index, url in enumerate(others):
            try:
                link = await self._open_link_to(url)
            except Exception as error:
                logger.warning(
                    "RabbitMQ: %s does not answer (%s); trying %s",
                    redact(url),
                    describe_error(error),
                    redact(order[index + 1]),
                )
                continue
            host.url = url
            return link
        link = await self._open_link_to(last)
        host.url = last
        return link

    async def _open_link_to(self, url: str) -> Link:
        """Open both connections and the publishing channel; set the link up."""
        aiormq = self.aiormq
        opened: list[AbstractConnection] = []
        try:
            with anyio.fail_after(self._host.connect_timeout):
                for role in ("publisher", "consumer"):
                    connection = await aiormq.connect(
                        url,
                        client_properties={
                            "connection_name": f"asyncbus {self._host.prefix} {role}"
                        },
                    )
                    opened.append(connection)
                channel = await opened[0].channel(publisher_confirms=True)
                link = Link(opened[0], opened[1], channel, self._lost)
                await self._host._set_up(link)
        except BaseException:  # deliberate: close what was opened on any way out
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                for connection in opened:
                    try:
                        await connection.close()
                    except Exception as error:
                        logger.debug("RabbitMQ: closing a half-open connection failed: %s", error)
            raise
        link.watch()
        if link.lost.is_set():
            await link.close()  # the other connection may still be open
            raise TransportError("the connection closed while it was being set up")
        return link

    def _lost(self, link: Link) -> None:
        self._host._link_lost(link)
        if self.link is link and not self.closing:
            self.event = anyio.Event()

    async def supervise(self) -> None:
        """Reconnect with exponential, jittered backoff whenever the connections drop."""
        host = self._host
        while True:
            link = self.link
            assert link is not None
            await link.lost.wait()
            if self.closing:
                return
            logger.warning("RabbitMQ: connection to %s lost; reconnecting", redact(host.url))
            for subscription in list(host._subscriptions):
                if subscription.consumer is not None:
                    subscription.lose(LOST)
            await link.close()
            backoff = Backoff(BACKOFF_MIN, host.max_backoff, jitter=True)
            while True:
                try:
                    new = await self._open_link()
                    break
                except Exception as error:
                    pause = backoff.next()
                    logger.warning(
                        "RabbitMQ: reconnecting to %s failed, retrying in %.2f s: %s",
                        redact(host.url),
                        pause,
                        error or type(error).__name__,
                    )
                    await anyio.sleep(pause)
            self.link = new
            self.event.set()
            logger.info("RabbitMQ: reconnected to %s", redact(host.url))

    async def wait(self, deadline: float | None) -> Link:
        """The live link, waiting for a reconnection up to ``deadline`` (anyio time)."""
        while True:
            if self.closing:
                raise TransportError("RabbitTransport is closed")
            link = self.link
            if link is not None and not link.lost.is_set():
                return link
            if not self._host._tasks.running:
                raise TransportError(
                    "RabbitTransport is not connected: use `async with transport` first"
                )
            event = self.event
            if deadline is None:
                await event.wait()
                continue
            with anyio.move_on_after(deadline - anyio.current_time()):
                await event.wait()
                continue
            raise TransportError(
                f"RabbitMQ at {redact(self._host.url)} unreachable for "
                f"{self._host.publish_timeout} s"
            )

    async def live(self) -> Link:
        """The live link, waiting for a reconnection up to ``publish_timeout``."""
        return await self.wait(anyio.current_time() + self._host.publish_timeout)

    def current(self) -> Link | None:
        """The link, unless it is lost (no waiting)."""
        link = self.link
        return link if link is not None and not link.lost.is_set() else None

    def unconfirmed(self, target: str) -> TransportError:
        """The error of a publish to ``target`` whose confirm did not come in time."""
        return TransportError(
            f"RabbitMQ at {redact(self._host.url)}: publishing to {target!r} not confirmed "
            f"within publish_timeout={self._host.publish_timeout:g} s (it may or may not be "
            "stored)"
        )

    def failed(self, what: str, error: BaseException) -> TransportError:
        """The error to raise when ``what`` failed with ``error``."""
        return TransportError(
            f"RabbitMQ at {redact(self._host.url)}: {what} failed: {error or type(error).__name__}"
        )

    async def call(
        self,
        what: str,
        operation: Callable[[Link], Awaitable[T]],
        deadline: float | None = None,
    ) -> T:
        """Run ``operation`` on the live link; retry it on a lost connection or channel.

        :param deadline: when to give up (anyio time); ``publish_timeout`` from now if unset.
        :raises TransportError: on a broker refusal, or once the deadline passed.
        """
        publish_timeout = self._host.publish_timeout
        if deadline is None:
            deadline = anyio.current_time() + publish_timeout
        backoff = Backoff(BACKOFF_MIN, self._host.max_backoff, jitter=True)
        while True:
            link = await self.wait(deadline)
            channel = link.channel
            try:
                # Bounded: a broker that stops answering (a confirm that never comes)
                # fails the call at the deadline instead of hanging it.
                with anyio.fail_after(max(0.0, deadline - anyio.current_time())):
                    return await operation(link)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
                problem: BaseException = TransportError("the connection closed")
            except (TransportError, ConfigurationError):
                raise
            except self.fatal as error:
                raise self.failed(what, error) from error
            except Exception as error:
                problem = error
                if isinstance(error, self.nacked):
                    await link.renew_channel(channel)
            if self.closing:
                raise TransportError("RabbitTransport is closed")
            if anyio.current_time() >= deadline:
                if isinstance(problem, TimeoutError):
                    problem = TimeoutError(
                        f"no answer within publish_timeout={publish_timeout:g} s"
                    )
                raise self.failed(what, problem) from problem
            if not link.lost.is_set():
                pause = backoff.next()
                logger.warning(
                    "RabbitMQ: %s failed, retrying in %.2f s: %s",
                    what,
                    pause,
                    problem or type(problem).__name__,
                )
                await anyio.sleep(pause)

    async def admin(self, link: Link, operation: Callable[[AbstractChannel], Awaitable[T]]) -> T:
        """Run ``operation`` on the link's admin channel (opened again if closed)."""
        async with link.admin_lock:
            admin = link.admin
            if admin is None or admin.is_closed:
                admin = link.admin = await link.publisher.channel(publisher_confirms=False)
            return await operation(admin)

    async def send(
        self,
        link: Link,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Basic.Properties,
        mandatory: bool = False,
    ) -> bool:
        """Publish one message on the link's publishing channel and wait for its confirm.

        :returns: whether a queue took it (always, unless ``mandatory``).
        """
        channel = link.channel
        if channel.is_closed:
            channel = await link.reopen_channel()
        try:
            await channel.basic_publish(
                body,
                exchange=exchange,
                routing_key=routing_key,
                properties=properties,
                mandatory=mandatory,
            )
        except self.returned:
            return False  # mandatory, and no queue is bound for it
        except self.nacked:
            await link.renew_channel(channel)  # (the next try opens a fresh one)
            raise
        return True
