"""Replies and slips: what a handled envelope's result becomes.

After a handler succeeded, ``routing_slip`` forwards its result (through the bus's
services): to the next hop of the envelope's slip (a new envelope, same correlation,
same deadline), or to the request waiting for it: in this process directly, in another
through the requester's inbox topic. A dead letter on the route fails the request
(:meth:`Replies.fail`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from . import _instrument
from ._backpressure import Backpressure
from ._dead_letters import DeadLetter, DeadLetterReason
from ._envelope import EMPTY_HEADERS, Envelope, Receipt, make_envelope, make_receipt, new_id
from ._exceptions import BusClosedError, HandlerError
from ._failures import describe_error
from ._modes import INBOX, Mode, ModeHost
from ._subscription import Subscription, make_subscription

__all__ = ["Replies", "Send"]

logger = logging.getLogger("asyncbus.bus")

#: How the bus sends an envelope of a kind (told to the instrumentation, then routed).
Send = Callable[[_instrument.SendKind, Envelope, "float | None"], Awaitable[Receipt]]


class _PendingReply:
    __slots__ = ("error", "event", "value")

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class Replies:
    """The requests of one bus waiting for their reply, and where results go on."""

    def __init__(
        self,
        name: str,
        mode: Mode,
        host: ModeHost,
        send: Send,
        subscribe: Callable[[Subscription], Subscription],
        subscribed: Callable[[], Awaitable[None]],
    ) -> None:
        self._name = name
        self._mode = mode
        self._host = host
        self._send = send
        self._subscribe = subscribe
        self._subscribed = subscribed
        self._requests: dict[str, _PendingReply] = {}
        #: The group (and topic prefix) of this bus's inbox over a broker, once opened.
        self.inbox: str | None = None

    # -- requests ---------------------------------------------------------------

    async def address(self, request_id: str) -> str:
        """Where the reply to request ``request_id`` is to go."""
        return await self._mode.reply_address(request_id, self._open_inbox)

    async def wait_for(
        self,
        envelope: Envelope,
        seconds: float | None,
        hold: Callable[[Envelope], Awaitable[Receipt]] | None = None,
    ) -> Any:
        """Send request ``envelope`` (or ``hold`` it until it is due) and wait (up to
        ``seconds``, counted from now) for its reply's value.

        :raises HandlerError: it is rejected at a door or dead-lettered on its route.
        :raises TimeoutError: no reply came in time.
        """
        reply_to = envelope.reply_to
        assert reply_to is not None
        pending = _PendingReply()
        self._requests[reply_to] = pending
        try:
            with anyio.fail_after(seconds):
                if hold is not None:
                    receipt = await hold(envelope)
                else:
                    receipt = await self._send("request", envelope, None)
                if pending.error is None and not pending.event.is_set():
                    if receipt.rejected:
                        raise rejected_at_the_door(envelope, receipt.rejected)
                    await pending.event.wait()
        finally:
            del self._requests[reply_to]
        if pending.error is not None:
            raise pending.error
        return pending.value

    def close(self) -> None:
        """The bus stops: every request still waiting fails with ``BusClosedError``."""
        for pending in self._requests.values():
            if not pending.event.is_set():
                pending.error = BusClosedError("the bus closed before the reply came")
                pending.event.set()

    def fail(
        self,
        entry: DeadLetter,
        cause: BaseException | None,
    ) -> None:
        """``entry`` died on a request's route: fail the request, here or elsewhere."""
        envelope = entry.envelope
        reply_to = envelope.reply_to
        if reply_to is None:
            if self.inbox is not None and envelope.topic.startswith(self.inbox):
                # A reply this bus could not take in (undecodable, refused by the inbox):
                # its request fails now instead of waiting for its timeout.
                pending = self._requests.get(envelope.topic)
                if pending is not None and not pending.event.is_set():
                    pending.error = HandlerError(
                        f"the reply to request {envelope.topic.rpartition('.')[2]} could not "
                        f"be read ({entry.reason.value}): {entry.error}",
                        envelope=envelope,
                        stage=entry.stage,
                        attempts=entry.attempts,
                    )
                    pending.event.set()
            return
        pending = self._requests.get(reply_to)
        if pending is None:
            if self._mode.replies_elsewhere(reply_to):
                self._host.start_background(self._fail_elsewhere, entry)
            return
        if not pending.event.is_set():
            reason, error, stage = entry.reason, entry.error, entry.stage
            where = f"{reason.value} in stage {stage}" if stage else reason.value
            failure = HandlerError(
                f"{where}: {error}" if error else f"{where} (topic {envelope.topic!r})",
                envelope=envelope,
                stage=stage,
                attempts=entry.attempts,
            )
            failure.__cause__ = cause
            pending.error = failure
            pending.event.set()

    async def _fail_elsewhere(self, entry: DeadLetter) -> None:
        await self._send_reply(
            entry.envelope,
            {
                "error": entry.error,
                "reason": entry.reason.value,
                "stage": entry.stage,
                "attempts": entry.attempts,
            },
        )

    # -- results ----------------------------------------------------------------

    async def forward(self, envelope: Envelope, result: Any) -> None:
        """Send a handled envelope's result on: to its next slip hop, or to its requester."""
        if envelope.slip:
            hop = make_envelope(
                new_id(),
                envelope.slip[0],
                result,  # the return value is the next payload, None included
                envelope.headers,
                envelope.timestamp,
                envelope.ttl,
                1,
                envelope.slip[1:],
                envelope.correlation_id,
                envelope.id,
                envelope.reply_to,
                envelope.sender,
            )
            try:
                receipt = await self._send("forward", hop, None)
            except Exception as error:
                self._host.dead_letter(
                    hop, DeadLetterReason.NO_SUBSCRIBERS, describe_error(error), None, 0, error
                )
                return
            if receipt.rejected and hop.reply_to is not None:
                pending = self._requests.get(hop.reply_to)
                if pending is not None and not pending.event.is_set():
                    pending.error = rejected_at_the_door(hop, receipt.rejected)
                    pending.event.set()
            return
        if envelope.reply_to is not None:
            pending = self._requests.get(envelope.reply_to)
            if pending is not None:
                instrumentation = self._host.instrumentation
                if instrumentation is not None:
                    # Answered in this process, without an envelope: observers see the
                    # reply one would have been, as a broker's replier sends it.
                    reply = self._reply_envelope(envelope, {"result": result})
                    _instrument.send_now(
                        instrumentation,
                        "reply",
                        reply,
                        self._mode.system,
                        lambda reply: make_receipt(reply.id, ()),
                    )
                if not pending.event.is_set():
                    pending.value = result
                    pending.event.set()
            elif self._mode.replies_elsewhere(envelope.reply_to):
                await self._send_reply(envelope, {"result": result})

    async def _send_reply(self, envelope: Envelope, body: dict[str, Any]) -> None:
        # A request made by another process: answer through its inbox topic.
        reply = self._reply_envelope(envelope, body)
        try:
            await self._send("reply", reply, None)
        except Exception:
            logger.warning("could not reply to %s", envelope.reply_to, exc_info=True)

    def _reply_envelope(self, envelope: Envelope, body: dict[str, Any]) -> Envelope:
        assert envelope.reply_to is not None
        return make_envelope(
            new_id(),
            envelope.reply_to,
            body,
            EMPTY_HEADERS,
            time.time(),
            None,
            1,
            (),
            envelope.correlation_id,
            envelope.id,
            None,
            self._name,
        )

    # -- the inbox (over a broker) ----------------------------------------------

    async def _on_reply(self, envelope: Envelope) -> None:
        """Handler of this bus's inbox: settle the request the reply answers."""
        pending = self._requests.get(envelope.topic)
        if pending is None or pending.event.is_set():
            return
        body = envelope.payload
        if type(body) is dict and "error" in body:
            stage, attempts = body.get("stage"), body.get("attempts")
            pending.error = HandlerError(
                f"{body.get('reason')} in stage {stage}: {body.get('error')}",
                envelope=envelope,
                stage=stage if isinstance(stage, str) else None,
                attempts=attempts if type(attempts) is int and attempts >= 0 else 0,
            )
        elif type(body) is dict and "result" in body:
            pending.value = body["result"]
        else:
            # Not written by a bus (another client wrote to the inbox): the request
            # fails now, rather than returning what is no answer or waiting for one.
            pending.error = HandlerError(
                f"the reply to request {envelope.topic.rpartition('.')[2]} is malformed: "
                f"expected an object with 'result' or 'error', got {_shown(body)}",
                envelope=envelope,
                stage=None,
                attempts=0,
            )
        pending.event.set()

    async def _open_inbox(self) -> str:
        """This bus's inbox, subscribed on first use (and waited for)."""
        if self.inbox is None:
            self.inbox = f"{INBOX}{uuid.uuid4().hex}"
            self._subscribe(
                make_subscription(
                    f"{self.inbox}.*",
                    self._on_reply,
                    group=self.inbox,
                    concurrency=1,
                    capacity=1024,
                    backpressure=Backpressure.BLOCK,
                    retry=None,
                    timeout=None,
                    offload=None,
                    middleware=(),
                )
            )
        await self._subscribed()
        return self.inbox


def rejected_at_the_door(envelope: Envelope, rejected: tuple[str, ...]) -> HandlerError:
    """The failure a request meets when a stage of its route refuses it (REJECT, full)."""
    return HandlerError(
        f"request to {envelope.topic!r} rejected at the door of {', '.join(rejected)}",
        envelope=envelope,
        stage=rejected[0],
        attempts=0,
    )


def _shown(value: Any) -> str:
    """A short description of a malformed value: its type, and its start."""
    try:
        text = repr(value)
    except Exception:  # a repr that fails (or recurses too deep) shows the type only
        text = "..."
    return f"{type(value).__name__} {text[:60]}"
