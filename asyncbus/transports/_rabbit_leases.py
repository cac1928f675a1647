"""The partitions of an ordered group leased over RabbitMQ (see :mod:`asyncbus._partitions`).

RabbitMQ keeps no key-value store, but it has what a lease needs, tied to the holder's
connection rather than to a clock:

* a partition's lease is an exclusive queue, ``{prefix}._asyncbus.partitions.
  {digest}.lease``: declaring it succeeds for one connection at a time, and it is
  deleted when that connection closes (the replica stopped, died, or lost the broker).
  A lease is kept for as long as the connection that took it is the transport's live
  one; once that connection is gone the lease is lost at once (another replica may
  take it at its next round), so it is never renewed by a round trip;
* a count (the group's replicas, and those short of their share) is the consumer count
  of a queue nobody publishes to, ``{prefix}._asyncbus.partitions.{digest}.count``:
  each replica counted in keeps a consumer on it, which goes with its connection;
* no mark is needed: RabbitMQ gives a dead consumer's unacknowledged messages back to
  the queue at once, so a partition left without a hand-over is read at once, and its
  held messages come first.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio

from .._exceptions import TransportError

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel

    from ._rabbit_link import Link


__all__ = ["RabbitPartitionLeases"]


class RabbitPartitionLeases:
    """A :class:`~asyncbus._leases.PartitionLeases` over RabbitMQ (see the module).

    :param prefix: the transport's prefix (the queues go under it).
    :param current_link: the transport's live link now, ``None`` while there is none.
    :param timeout: seconds a call to the broker may take (the transport's
        ``publish_timeout``) before it fails with :class:`TransportError`.
    """

    def __init__(
        self, prefix: str, current_link: Callable[[], Link | None], timeout: float
    ) -> None:
        self._prefix = prefix
        self._current_link = current_link
        self._timeout = timeout
        #: Lease name -> the link whose connection holds its exclusive queue.
        self._held: dict[str, Link] = {}
        #: (name, member) -> the link and channel of its count-in consumer.
        self._counted: dict[tuple[str, str], tuple[Link, AbstractChannel]] = {}

    def _queue(self, name: str, kind: str) -> str:
        digest = hashlib.sha256(name.encode()).hexdigest()[:32]
        return f"{self._prefix}._asyncbus.partitions.{digest}.{kind}"

    def _link(self) -> Link:
        link = self._current_link()
        if link is None or link.lost.is_set():
            raise TransportError("RabbitMQ: not connected (partitions' leases)")
        return link

    @asynccontextmanager
    async def _channel(self, link: Link, doing: str) -> AsyncIterator[AbstractChannel]:
        """A channel of the link's publishing connection, closed after use; the client's
        errors become :class:`TransportError` saying what was being done."""
        try:
            with anyio.fail_after(self._timeout):
                channel = await link.publisher.channel(publisher_confirms=False)
        except Exception as error:  # aiormq's (the connection closed under us), a timeout
            raise _failed(doing, error) from error
        try:
            with anyio.fail_after(self._timeout):
                yield channel
        except (TransportError, anyio.get_cancelled_exc_class()):
            raise
        except Exception as error:  # aiormq's, a timeout
            raise _failed(doing, error) from error
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                if not channel.is_closed:
                    with contextlib.suppress(Exception):  # closed by the broker already
                        await channel.close()

    async def count_in(self, name: str, member: str) -> int:
        """Keep a consumer of ``member`` on the count's queue: how many there are."""
        link = self._link()
        counted = self._counted.get((name, member))
        if counted is None or counted[0] is not link or counted[1].is_closed:
            queue = self._queue(name, "count")
            doing = f"counting in {name!r}"
            try:
                with anyio.fail_after(self._timeout):
                    channel = await link.publisher.channel(publisher_confirms=False)
                    await channel.queue_declare(queue, auto_delete=True)
                    await channel.basic_consume(queue, _ignore, no_ack=True, consumer_tag=member)
            except Exception as error:  # aiormq's, a timeout
                raise _failed(doing, error) from error
            self._counted[name, member] = (link, channel)
        return await self.count(name)

    async def count_out(self, name: str, member: str) -> None:
        """Drop ``member``'s consumer (its channel closed with it)."""
        counted = self._counted.pop((name, member), None)
        if counted is not None and not counted[1].is_closed:
            try:
                with anyio.fail_after(self._timeout):
                    await counted[1].close()
            except Exception as error:  # aiormq's, a timeout
                raise _failed(f"counting out of {name!r}", error) from error

    async def count(self, name: str) -> int:
        """The consumers of the count's queue (0 when it is gone)."""
        import aiormq.exceptions

        async with self._channel(self._link(), f"counting {name!r}") as channel:
            try:
                declared = await channel.queue_declare(self._queue(name, "count"), passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return 0
        return int(declared.consumer_count or 0)

    async def take(self, name: str, member: str) -> bool:
        """Declare the lease's exclusive queue: whether this connection holds it now."""
        import aiormq.exceptions

        link = self._link()
        if self._held.get(name) is link:
            return True
        async with self._channel(link, f"taking {name!r}") as channel:
            try:
                await channel.queue_declare(self._queue(name, "lease"), exclusive=True)
            except aiormq.exceptions.ChannelLockedResource:
                return False  # another connection holds it (the broker closed the channel)
        self._held[name] = link
        return True

    async def keep(self, name: str, member: str) -> bool:
        """Whether the connection that took the lease is still the live one."""
        link = self._held.get(name)
        if link is not None and link is self._current_link() and not link.lost.is_set():
            return True
        self._held.pop(name, None)
        return False

    async def give(self, name: str, member: str) -> None:
        """Delete the lease's queue, when this connection holds it."""
        link = self._held.pop(name, None)
        if link is None or link is not self._current_link() or link.lost.is_set():
            return  # gone with its connection
        async with self._channel(link, f"giving {name!r} back") as channel:
            await channel.queue_delete(self._queue(name, "lease"))

    async def mark(self, name: str) -> None:
        """No mark over RabbitMQ (see the module)."""

    async def unmark(self, name: str) -> None:
        """No mark over RabbitMQ (see the module)."""

    async def marked(self, name: str) -> bool:
        """Never: RabbitMQ gives a dead consumer's messages back at once."""
        return False


async def _ignore(message: Any) -> None:
    """Nothing is published to a count's queue."""


def _failed(doing: str, error: BaseException) -> TransportError:
    return TransportError(f"RabbitMQ: {doing} failed: {type(error).__name__}: {error}")
