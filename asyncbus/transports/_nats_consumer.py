"""The consuming side of the NATS JetStream transport: pull requests and what they bring.

A :class:`PullConsumer` is one ``subscribe()`` of a group's durable consumer (made and
ended by :mod:`._nats_subscriptions`): it keeps one pull request open for as much as it
has room for, files what arrives on its private inbox, turns messages into deliveries
(:mod:`._nats_delivery`) and gives back what it held when the subscription ends. The
broker calls that outlive it (making a vanished consumer again, writing acks behind,
recording hand-backs) go through its transport (:mod:`asyncbus.transports.nats`),
described by :class:`PullHost`.

The bus steers it (``SubscriptionControl``): ``set_prefetch`` brings its room down or
up (what was received beyond goes back, recorded as hand-backs, and waits
``give_back_delay``, past the open pull request, so that it does not take it straight
back), and
``flush`` writes its acks. A delivery's ``redeliveries`` is ``num_delivered`` less its
hand-backs, less one; its ``queued_at`` is the stream's stored time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import anyio

from .._exceptions import ConfigurationError, TransportError
from ._kit import Backoff
from ._kit.options import checked_prefetch
from ._kit.redeliveries import over_max_deliveries as exceeded
from ._nats_client import broker_call
from ._nats_delivery import MessageKey, NatsDelivery, SettleHost, make_delivery, message_key
from ._nats_messages import HEADER_REPLAY_GROUP
from .base import Delivery

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from ._nats_handbacks import HandBacks

__all__ = ["PullConsumer", "PullHost"]

logger = logging.getLogger("asyncbus.transport.nats")

#: Why a delivery its subscription gave back cannot be settled.
RELEASED = "was released when its subscription ended"
#: Past expiry plus this, a request that never answered (server restart) is forgotten.
_PULL_GRACE = 1.0
#: Seconds to wait before asking again after the server refused a pull request.
_PULL_PAUSE = 0.25
#: Longest wait between two attempts to make a vanished stream or consumer again.
_RESTORE_BACKOFF_MAX = 2.0
#: Messages a subscription remembers having settled, to know a copy sent again.
_SETTLED_KEPT = 1024


class PullHost(SettleHost, Protocol):
    """What pull consumers use of their transport (:class:`~.nats.NatsTransport` is one):
    settings, acks written behind, hand-backs, and making a vanished consumer again."""

    stream: str
    ack_timeout: float
    max_deliveries: int
    _handbacks: HandBacks

    @property
    def pull_expires(self) -> float:
        """Seconds each pull request lives on the server."""
        ...

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded clean-up scope, bounded by the close deadline."""
        ...

    async def _consumer_exists(self, name: str) -> bool:
        """Whether the durable consumer ``name`` is on the server (``False``: the server
        says it, or its stream, does not exist).

        :raises TransportError: when the server does not answer (within
            ``request_timeout``) or answers something else.
        """
        ...

    async def _restore(self, consumer: PullConsumer | None = None) -> None:
        """Make the streams and this transport's consumers again (``consumer`` first)."""
        ...


class PullConsumer:
    """One ``subscribe()`` context: its pull request, messages and unsettled deliveries.

    One pull request is open at a time, for as many messages as there is room for:
    what was asked for plus what is held never exceeds ``prefetch``. Messages arrive
    on a private inbox and wait in :attr:`ready` until the iterator hands them out.
    JetStream delivers messages under their own subject, so a message cannot be
    told to belong to a request; status replies (408 expired, 409 ...) come on the
    request's reply subject (``{inbox}.{n}``), so a stale request's end is ignored.

    A message can arrive again while it is held, or just after it was acked (the ack
    still on its way): a 2.9 server was seen to send one of the messages a consumer
    had given back twice, the second time as if new, and another one not at all until
    ``ack_wait``. A copy of a held message is dropped (the one held settles it: acks
    and naks name the stream message, not the delivery); a copy of one this
    subscription acked or terminated is acked again, never handled twice.
    """

    def __init__(
        self, transport: PullHost, nc: Client, name: str, pattern: str, group: str, prefetch: int
    ) -> None:
        self.transport = transport
        self.nc = nc
        self.pattern = pattern
        self.group = group
        self.name = name
        self.stage = f"{pattern}@{group}"
        self.prefetch = prefetch
        self.max_deliveries = transport.max_deliveries
        self.inbox = nc.new_inbox()
        self.next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{transport.stream}.{self.name}"
        self.ready: deque[Msg] = deque()
        self.unsettled: dict[int, NatsDelivery] = {}
        #: The messages in :attr:`ready` and :attr:`unsettled`, and the last ones acked
        #: or terminated here (see the class's note on copies).
        self.held: set[MessageKey] = set()
        self.settled: OrderedDict[MessageKey, None] = OrderedDict()
        #: Reply subject of the open pull request, what it may still bring, its deadline.
        self.request: str | None = None
        self.remaining = 0
        self.deadline = 0.0
        self.sequence = 0
        self.pause_until = 0.0
        #: Why the consumer cannot be pulled from (it, or its stream, is gone), until
        #: :meth:`restore` made it again.
        self.failure: str | None = None
        #: Why it may be gone (a pull answered "no responders", or never answered): the
        #: next pull asks the server first, and only a consumer it says is gone is
        #: made again.
        self.doubt: str | None = None
        self.restore_backoff = Backoff(_PULL_PAUSE, _RESTORE_BACKOFF_MAX)
        self.closed = False
        self.wakeup = anyio.Event()
        #: Messages of a left subscription, given back together once its request ended.
        self.lingering: list[Msg] = []

    def wake(self) -> None:
        self.wakeup.set()

    def forget(self, delivery: NatsDelivery) -> None:
        """A delivery was settled: there is room for another."""
        self.unsettled.pop(id(delivery), None)
        self.held.discard(delivery._key)
        self.wakeup.set()

    def settled_for_good(self, key: MessageKey) -> None:
        """The message ``key`` was acked or terminated: a copy of it that arrives is
        acked again."""
        settled = self.settled
        settled[key] = None
        if len(settled) > _SETTLED_KEPT:
            settled.popitem(last=False)

    def _is_copy(self, msg: Msg, key: MessageKey) -> bool:
        """Whether ``msg`` (stream message ``key``) delivers again a message held or
        settled here (then it is dropped, or acked again)."""
        if key in self.held:
            logger.debug("NATS: %s sent stream message %s again while held", self.name, key[0])
            return True
        if key in self.settled:
            logger.debug("NATS: %s sent stream message %s again once settled", self.name, key[0])
            with contextlib.suppress(TransportError):  # closing: it comes back at worst
                self.transport._acks.queue(self.name, self.stage, msg.reply, key[1])
            return True
        return False

    async def on_message(self, msg: Msg) -> None:
        """nats-py's callback for the inbox: file a message or a request's status."""
        headers = msg.headers
        if not msg.reply and headers and "Status" in headers:
            status = headers["Status"]
            if status == "100" or msg.subject != self.request:
                return  # an idle heartbeat, or the end of a request already given up
            self.request = None
            # nats-py keys it by an Enum whose hash is not the string's: compare instead.
            description = next((v for k, v in headers.items() if k == "Description"), "")
            if status == "409" and "Deleted" in description:
                self.failure = (
                    f"consumer {self.name} of stream {self.transport.stream} is gone "
                    f"({status} {description})".rstrip()
                )
                # Not at once: a stream being deleted ends its consumers' requests
                # first, and one made again before its files are gone loses them.
                self.pause_until = time.monotonic() + _PULL_PAUSE
            elif status == "503":
                # No responders: the consumer is gone (a server that lost its state), or
                # its cluster is electing the consumer's leader. The next pull, after a
                # pause, asks the server which (request_more) before making it again.
                self.doubt = f"{status} {description or 'No Responders'}"
                self.pause_until = time.monotonic() + _PULL_PAUSE
            elif status not in ("404", "408"):
                # 409 (too many waiting requests, leadership change...) and the like:
                # ask again, but not in a tight loop.
                self.pause_until = time.monotonic() + _PULL_PAUSE
                logger.debug("pull request for %s ended: %s %s", self.name, status, description)
            self.wake()
            return
        if not (msg.reply or "").startswith("$JS.ACK."):
            # Not from JetStream (someone published to this private inbox): nothing to
            # settle, nothing to hand over.
            logger.warning("NATS: ignoring a message on %s not sent by JetStream", msg.subject)
            return
        if self.request is not None:
            self.remaining -= 1
            if self.remaining <= 0:
                self.request = None
        key = message_key(msg)
        if self.closed:
            # Our request outlived the subscription: kept, and given back with the rest
            # once the request ended (given back now, the server would send it straight
            # back into the same request, again and again, and the last copy sent as
            # the request ended would wait for ack_wait, behind later messages).
            self.lingering.append(msg)
        elif self._is_copy(msg, key):
            pass
        elif len(self.unsettled) + len(self.ready) >= self.prefetch:
            # The prefetch came down while the request was open: not ours to hold.
            await self._give_back([msg], self.give_back_delay)
        else:
            self.ready.append(msg)
            self.held.add(key)
        self.wake()

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` unsettled messages (see ``SubscriptionControl``):
        received ones beyond it go back, uncounted (the newest first), and so do those
        an open pull request still brings beyond it.

        A pull request cannot be taken back: what goes back waits
        :attr:`give_back_delay` before it is delivered again, so that it does not come
        straight back into the request that is still open (a message held here when the
        process dies counts as a delivery).
        """
        self.prefetch = checked_prefetch(prefetch)
        excess = min(len(self.unsettled) + len(self.ready) - self.prefetch, len(self.ready))
        if excess > 0:
            given = [self.ready.pop() for _ in range(excess)]
            self.held.difference_update(message_key(msg) for msg in given)
            with self.transport.cleanup_scope(self.transport.request_timeout):
                await self._give_back(given, self.give_back_delay)
        self.wake()  # (room for a larger pull request, perhaps)

    @property
    def give_back_delay(self) -> float:
        """Seconds what this subscription gives back waits before it is delivered again:
        past the pull request open now (``pull_expires``), and half a request more, at
        most a second. Not the request's own length: the request opened as the messages
        go back would expire just as they come due, and a 2.9 server that redelivers at
        that instant was seen to lose one into the ending request (delivered, so
        counted, until ``ack_wait``) and send another twice."""
        expires = self.transport.pull_expires
        return expires + min(expires / 2, 1.0)

    async def flush(self) -> None:
        """Write (and have confirmed) the acks queued for this consumer (see
        ``SubscriptionControl``)."""
        with self.transport.cleanup_scope(self.transport.request_timeout):
            await self.transport._acks.flush([self.name])

    async def request_more(self) -> None:
        """Open a pull request for as many messages as there is room for, unless one is open."""
        now = time.monotonic()
        if (self.request is not None and self.deadline >= now) or now < self.pause_until:
            return
        if self.request is not None:
            # The request never answered, not even 408 at its expiry: the server
            # restarted, or the consumer is gone (a pull on it gets no reply at all).
            self.request = None
            self.doubt = "its pull request was never answered"
        if self.doubt is not None:
            doubt, self.doubt = self.doubt, None
            try:
                gone = not await self.transport._consumer_exists(self.name)
            except TransportError:
                # No answer (its cluster electing a leader) or not connected right now
                # (nats-py reconnects): no news that it is gone; pull again.
                gone = False
            if gone:
                self.failure = (
                    f"consumer {self.name} of stream {self.transport.stream} is gone ({doubt})"
                )
                return
        room = self.prefetch - len(self.unsettled) - len(self.ready)
        if room <= 0:
            self.request = None
            return
        self.sequence += 1
        self.request = f"{self.inbox}.{self.sequence}"
        self.remaining = room
        # Past its expiry plus a grace, a request that never answered (the server
        # restarted meanwhile) is given up and a new one opened.
        expires = self.transport.pull_expires
        self.deadline = now + expires + _PULL_GRACE
        ask = json.dumps({"batch": room, "expires": int(expires * 1e9)}).encode()
        with broker_call(f"cannot pull from consumer {self.name}"):
            await self.nc.publish(self.next_subject, ask, reply=self.request)

    def _next_deadline(self) -> float:
        now = time.monotonic()
        if now < self.pause_until:
            return self.pause_until - now
        if self.request is None:
            return float("inf")  # nothing asked for: wait for room (a settle)
        return max(0.0, self.deadline - now)

    def __aiter__(self) -> PullConsumer:
        return self

    async def __anext__(self) -> Delivery:
        """The next delivery; cancelling the wait for it loses nothing."""
        while True:
            if self.closed:
                raise StopAsyncIteration
            if self.ready and self.failure is None:
                wakeup = self.wakeup  # a message is at hand: no waiting this time
            else:
                wakeup = self.wakeup = anyio.Event()
            if self.nc.is_closed:
                raise TransportError("the connection to NATS is closed")
            if self.failure is not None:
                await self.restore()
                continue
            await self.request_more()
            if self.failure is not None:
                continue
            if not self.ready:
                with anyio.move_on_after(self._next_deadline()):
                    await wakeup.wait()
                continue
            msg = self.ready.popleft()
            delivery = make_delivery(self, msg)
            if delivery is None:
                # A replay meant for another group: not ours to handle.
                self.held.discard(message_key(msg))
                with broker_call("cannot skip a replay for another group"):
                    await msg.ack()
                continue
            if delivery.envelope.attempt > 1:  # delivered before: by a hand-back, or lost
                delivered = await self.counted_deliveries(msg)
                delivery.redeliveries = delivered - 1
                if delivery.error is None:
                    delivery.error = exceeded(delivered, self.max_deliveries)
            self.unsettled[id(delivery)] = delivery
            return delivery

    async def counted_deliveries(self, msg: Msg) -> int:
        """How many times JetStream delivered ``msg``, this time included, not counting
        the deliveries consumers handed back unhandled."""
        metadata = msg.metadata
        delivered = metadata.num_delivered or 1
        if delivered > 1:
            delivered -= await self.transport._handbacks.count(self.name, metadata.sequence.stream)
        return max(delivered, 1)

    async def restore(self) -> None:
        """Make the stream and this consumer again (a server that lost its state, a
        consumer or stream deleted by someone); on failure, wait and let the caller
        try again."""
        now = time.monotonic()
        if now < self.pause_until:
            wakeup = self.wakeup
            with anyio.move_on_after(self.pause_until - now):
                await wakeup.wait()
            return
        logger.warning("NATS: %s; making it again", self.failure)
        try:
            await self.transport._restore(self)
        except (TransportError, ConfigurationError) as error:
            logger.warning("NATS: making consumer %s again failed: %s", self.name, error)
            self.pause_until = time.monotonic() + self.restore_backoff.next()
            return
        self.failure = None
        self.request = None
        self.restore_backoff.reset()

    async def keep_alive(self) -> None:
        """Tell the server held deliveries are being worked on (``+WPI``).

        Deliveries wait in the bus's stage queue and for retries; without this they
        would be redelivered to the group every ``ack_timeout`` while still held. A
        process that dies stops sending it, so its deliveries still come back.
        """
        interval = max(self.transport.ack_timeout / 3, 0.05)
        while not self.closed:
            await anyio.sleep(interval)
            held = [d._msg for d in self.unsettled.values() if d.settleable]
            for msg in [*held, *self.ready]:
                try:
                    await msg.in_progress()
                except Exception:  # the connection is gone: redelivery takes over
                    logger.debug("in-progress for %s failed", self.name, exc_info=True)
                    break

    async def release(self, subscription: Subscription) -> bool:
        """Give back everything held but not settled, so another consumer gets it now.

        :return: whether the inbox is closed; ``False`` when a pull request is still
            open on the server, and :meth:`linger` must keep the inbox until it ends.
        """
        self.closed = True
        held = [d._msg for d in self.unsettled.values() if d.settleable]
        for delivery in self.unsettled.values():
            delivery.take_back(RELEASED)
        self.unsettled.clear()
        held += self.ready
        self.ready.clear()
        self.held.clear()
        if self.request is None or self.nc.is_closed:
            await self._unsubscribe(subscription)
            await self._give_back(held + self._take_lingering())
            return True
        # Not unsubscribing yet: a 2.9 server that finds a redelivery's only waiting
        # request without interest loses that redelivery until ack_wait and sends
        # another message twice. What reaches the open request meanwhile is kept
        # (on_message) and given back with what was held, in stream order, once the
        # request ended: the next consumer then gets them first, in order.
        self.lingering += held
        return False

    def _take_lingering(self) -> list[Msg]:
        taken, self.lingering = self.lingering, []
        return taken

    async def linger(self, subscription: Subscription) -> None:
        """Keep the inbox of a left subscription until its open pull request ended."""
        try:
            with anyio.move_on_after(max(0.0, self.deadline - time.monotonic())):
                while self.request is not None:
                    wakeup = self.wakeup = anyio.Event()
                    await wakeup.wait()
        finally:
            with self.transport.cleanup_scope():
                await self._unsubscribe(subscription)
                await self._give_back(self._take_lingering())

    async def _unsubscribe(self, subscription: Subscription) -> None:
        """Unsubscribe; messages the server sent before it saw that are given back too."""
        drained = False
        if not self.nc.is_closed:
            try:
                with anyio.move_on_after(self.transport.request_timeout):
                    await subscription.drain()  # type: ignore[no-untyped-call]
                    drained = True
            except Exception:
                logger.debug("draining the inbox of %s failed", self.name, exc_info=True)
        if not drained:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _give_back(self, msgs: list[Msg], delay: float | None = None) -> None:
        """Nak them, oldest first (ack the replays that were for another group), to be
        delivered again at once or after ``delay`` seconds.

        Each one given back is recorded first (:mod:`._nats_handbacks`): handed back
        unhandled, it is no delivery toward ``max_deliveries``.
        """
        msgs.sort(key=lambda msg: msg.metadata.sequence.stream)
        ours = [
            msg for msg in msgs if (msg.headers or {}).get(HEADER_REPLAY_GROUP) in (None, self.name)
        ]
        if ours and not self.nc.is_closed:
            await self.transport._handbacks.record(self.name, ours)
        mine = {id(msg) for msg in ours}
        for msg in msgs:
            try:
                if id(msg) in mine:
                    await msg.nak(delay=delay)
                else:
                    await msg.ack()
            except Exception:  # redelivered after ack_wait instead
                logger.debug("could not give back a message of %s", self.name, exc_info=True)
                return
