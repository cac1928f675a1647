"""One consumer channel of the RabbitMQ transport and the acks it owes the broker (written
by :func:`write_acks`), and the two asyncio helpers its calls need (aiormq runs on
asyncio only)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel

__all__ = ["ConsumerChannel", "retrieve", "spurious_cancel", "write_acks"]

logger = logging.getLogger("asyncbus.transport.rabbit")


def retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a done future's exception as retrieved (asyncio logs unretrieved ones)."""
    if not future.cancelled():
        future.exception()


def spurious_cancel() -> bool:
    """Whether a ``CancelledError`` came from the client library, not a cancel request."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class ConsumerChannel:
    """One channel of a subscription, and which of its delivery tags are settled.

    Its acks are queued in the transport's :class:`~._kit.AckWriter` under it and
    written by :meth:`flush`: at once when ``ack_batch`` of them wait (half the
    channel's prefetch: the broker is never kept from sending more while they linger).
    """

    __slots__ = (
        "ack_batch",
        "channel",
        "consuming",
        "done",
        "lock",
        "next_tag",
        "prefetch",
        "tag",
    )

    def __init__(self, channel: AbstractChannel, prefetch: int = 0) -> None:
        self.channel = channel
        self.prefetch = self.ack_batch = 0
        self.resize(prefetch)
        self.tag = ""
        self.consuming = False
        #: Every delivery tag below this one is settled and written.
        self.next_tag = 1
        #: Settled tags from ``next_tag`` on: given back (nacked one by one), or acked
        #: by the write going on.
        self.done: set[int] = set()
        self.lock = anyio.Lock()

    def resize(self, prefetch: int) -> None:
        """The prefetch of the channel's next consumer (set with ``basic.qos``)."""
        #: The channel's ``basic.qos`` prefetch (what a round trip on it sets again).
        self.prefetch = prefetch
        #: Acks waiting under this channel that make the writer write without lingering.
        self.ack_batch = max(1, prefetch // 2)

    async def flush(self, acks: list[int]) -> bool:
        """Write ``acks``: one ``multiple`` for the contiguous run, single ones after;
        then a round trip on the channel, so the broker is known to have them.

        Each tag is written at most once, however often it is asked for: a tag counts as
        written as soon as its frame is handed to the connection, so a write cut short
        (the clean-up deadline, or a drain's timeout, while the socket drains) and
        tried again by the writer writes only the rest. RabbitMQ closes a channel that
        acks a tag twice, taking every other delivery it holds back to the queue; a
        tag whose frame never left (cut short while the connection's frame queue was
        full) is delivered again when the channel closes, as at-least-once allows.

        AMQP never answers an ack, and a frame handed to a connection nobody reads (a
        black-holed broker) is not one the broker took: the round trip after them
        (``basic.qos``, answered in order after every frame before it) is what says
        it did. A flush cut short before its answer raises, and the writer asks again:
        the tags are not written twice, the round trip is made again.

        :returns: whether the broker has them (``False``: the channel is gone, and its
            deliveries with it: the broker returns them).
        """
        async with self.lock:
            done = self.done
            # Taken in here, under the lock, not when queued: a tag acked meanwhile
            # (queued for the next write) must stop the contiguous run below. Tags
            # below ``next_tag`` or in ``done`` were written already.
            fresh = {tag for tag in acks if tag >= self.next_tag and tag not in done}
            tag = self.next_tag
            last = 0
            while tag in done or tag in fresh:
                if tag in fresh:
                    last = tag
                tag += 1
            # A multiple ack must name a tag still unacked: the last fresh one.
            done.difference_update(range(self.next_tag, tag))
            self.next_tag = tag
            singles = sorted(single for single in fresh if single >= tag)
            done.update(singles)
            try:
                if last:
                    await self.channel.basic_ack(last, multiple=True)
                for single in singles:
                    await self.channel.basic_ack(single)
                await self.channel.basic_qos(prefetch_count=self.prefetch)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
                return False  # the client closed the channel under the call
            except Exception as error:
                logger.debug("RabbitMQ: acks lost with their channel: %s", error)
                return False
            return True

    async def give_back(self, tags: Sequence[int]) -> None:
        """``basic.nack`` with requeue: the broker gives them to a consumer again.

        A tag counts as settled (``done``) only once its nack is queued (``wait=False``:
        a call that returns has queued its frame, one cut short has not): a later
        ``multiple`` ack must never cover a delivery whose nack was not written.
        """
        async with self.lock:
            try:
                for tag in tags:
                    if tag >= self.next_tag and tag not in self.done:
                        await self.channel.basic_nack(tag, requeue=True, wait=False)
                        self.done.add(tag)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
            except Exception as error:
                logger.debug("RabbitMQ: nack lost with its channel: %s", error)


async def write_acks(
    batch: dict[ConsumerChannel, list[tuple[int, str | None]]],
) -> list[ConsumerChannel]:
    """Write each channel's acks (the transport's ack writer hands them over, with the
    envelope ids); return the channels that are gone (their acks lost)."""
    lost: list[ConsumerChannel] = []
    for consumer, acks in batch.items():
        if not await consumer.flush([tag for tag, _id in acks]):
            lost.append(consumer)
    return lost
