"""JetStream publishes that share one reply inbox: many in flight, each awaited alone.

nats-py's ``js.publish`` is a request: a fresh inbox token, a future and a
``wait_for`` timer per message, which costs more than the message itself when a
service publishes from many tasks at once. :class:`JetStreamPublisher` subscribes
once to ``{inbox}.*``, sends each message with ``reply={inbox}.{n}`` and keeps its
future under ``n``; the stream's ack (or its error) resolves the future. One task
fails the futures not answered within ``timeout`` (in publish order, so it only
ever looks at the oldest), instead of a timer per message; it runs in the
transport's own tasks (:class:`~._kit.TaskOwner`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._exceptions import TransportError
from ._kit import TaskOwner

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

__all__ = ["JetStreamPublisher", "NoStreamError"]

#: Status of the reply when no stream captures the subject.
_NO_RESPONDERS = "503"


class NoStreamError(TransportError):
    """No JetStream stream captures the subject (the server answered "no responders")."""


class JetStreamPublisher:
    """Publishes to JetStream and waits for each stream ack (see the module docstring).

    :param nc: a connected client.
    :param timeout: seconds to wait for a stream's ack before :class:`TimeoutError`.
    """

    def __init__(self, nc: Client, timeout: float) -> None:
        self._nc = nc
        self._timeout = timeout
        self._prefix = ""
        self._tokens = itertools.count()
        #: Unanswered publishes, oldest first: token -> (future, deadline).
        self._waiting: dict[str, tuple[asyncio.Future[None], float]] = {}
        self._subscription: Subscription | None = None
        self._stopped = False

    async def start(self, tasks: TaskOwner) -> None:
        """Subscribe to the reply inbox; run the expiry task in ``tasks``."""
        self._prefix = f"{self._nc.new_inbox()}."
        self._subscription = await self._nc.subscribe(f"{self._prefix}*", cb=self._on_reply)
        tasks.start_soon(self._expire, name="asyncbus NATS publish expiry")

    async def stop(self) -> None:
        """Stop expiring, and fail what still waits (the connection is closing)."""
        self._stopped = True
        waiting, self._waiting = self._waiting, {}
        for future, _deadline in waiting.values():
            if not future.done():
                future.set_exception(TransportError("the NATS connection closed before the ack"))

    async def publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Publish one message and return once its stream stored it.

        :raises NoStreamError: when no stream captures ``subject``.
        :raises TransportError: when the stream refused the message.
        :raises TimeoutError: when no ack came within ``timeout``.
        """
        token = str(next(self._tokens))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting[token] = (future, time.monotonic() + self._timeout)
        try:
            await self._nc.publish(subject, body, reply=self._prefix + token, headers=headers)
            await future
        finally:
            self._waiting.pop(token, None)

    async def publish_many(
        self, subject: str, messages: Sequence[tuple[bytes, dict[str, str]]]
    ) -> None:
        """Publish every message, pipelined (all written before any ack is awaited, so
        nats-py sends them in one write), and return once the stream stored them all.

        :raises NoStreamError: when no stream captures ``subject``.
        :raises TransportError: when the stream refused a message (the first refused).
        :raises TimeoutError: when an ack did not come within ``timeout``.
        """
        create_future = asyncio.get_running_loop().create_future
        waiting = self._waiting
        deadline = time.monotonic() + self._timeout
        tokens = self._tokens
        sent: list[tuple[str, asyncio.Future[None]]] = []
        publish = self._nc.publish
        prefix = self._prefix
        try:
            for body, headers in messages:
                token = str(next(tokens))
                future: asyncio.Future[None] = create_future()
                waiting[token] = (future, deadline)
                sent.append((token, future))
                await publish(subject, body, reply=prefix + token, headers=headers)
            for _token, future in sent:
                await future
        finally:
            for token, future in sent:
                waiting.pop(token, None)
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: only the first failure is raised
                else:
                    future.cancel()

    async def _on_reply(self, msg: Msg) -> None:
        entry = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if entry is None or entry[0].done():
            return  # answered after its timeout, or its publisher was cancelled
        future = entry[0]
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            future.set_exception(NoStreamError("no JetStream stream captures the subject"))
            return
        try:
            answer: Any = json.loads(msg.data)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to read
            answer = None
        if type(answer) is dict and type(answer.get("error")) is dict:
            error = answer["error"]
            future.set_exception(
                TransportError(
                    f"JetStream refused the message: {error.get('description', error)} "
                    f"(code {error.get('err_code', error.get('code', '?'))})"
                )
            )
        elif type(answer) is dict and type(answer.get("stream")) is str and "seq" in answer:
            future.set_result(None)
        else:
            # Not an ack JetStream writes (someone else answered on the inbox): the
            # message may or may not be stored, as after a timeout.
            future.set_exception(
                TransportError(f"unreadable ack from JetStream: {msg.data[:80]!r}")
            )

    async def _expire(self) -> None:
        while not self._stopped:
            await asyncio.sleep(min(self._timeout / 4, 0.25))
            waiting = self._waiting
            now = time.monotonic()
            while waiting:
                token, (future, deadline) = next(iter(waiting.items()))
                if deadline > now:
                    break  # the oldest is not due: none is (one timeout for all)
                del waiting[token]
                if not future.done():
                    future.set_exception(
                        TimeoutError(f"no ack from JetStream within {self._timeout:g} s")
                    )
