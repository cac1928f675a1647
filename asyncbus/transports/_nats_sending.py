"""Envelopes onto the NATS transport's stream: checked subjects, one pipelined send.

A topic's subject is checked once (a few hundred are kept), every envelope becomes a
message (:mod:`._nats_messages`). A send waits while the streams are being made again
(:mod:`._nats_restore`), writes them all before awaiting any ack
(:mod:`._nats_publisher`) and returns once the stream stored every one. A send no
stream answered ("no responders") asks the server whether the stream exists: when it
says it does not, the streams are made again and the send repeated; when it does not
say (a cluster electing the stream's leader answers nothing for a second or two), the
send is repeated every 0.25 s until ``publish_timeout``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import anyio

from .._envelope import Envelope
from .._exceptions import ConfigurationError, TransportError
from .._routing import compile_pattern, validate_topic
from ._codec import Codec
from ._nats_messages import envelope_message
from ._nats_publisher import NoStreamError
from .base import TopicLimits

if TYPE_CHECKING:
    from ._nats_connection import NatsConnection
    from ._nats_restore import Restorer
    from ._nats_streams import JetStreamSetup

__all__ = ["EnvelopeSender", "SenderHost"]

logger = logging.getLogger("asyncbus.transport.nats")

#: Topics whose subject is kept checked (then the cache starts over).
_SUBJECTS_KEPT = 512
#: Seconds between two publishes that no stream answered while its cluster elects.
_ELECTION_PAUSE = 0.25


class SenderHost(Protocol):
    """What sending uses of its transport (:class:`~.nats.NatsTransport`)."""

    prefix: str
    stream: str
    codec: Codec
    limits: TopicLimits
    publish_timeout: float
    request_timeout: float


class EnvelopeSender:
    """Sends the envelopes of ``host`` (see the module docstring).

    :param connection: the transport's connection.
    :param restorer: what makes vanished streams again (and what a send waits for).
    :param setup: what makes a group's consumer (a send to one group).
    """

    def __init__(
        self,
        host: SenderHost,
        connection: NatsConnection,
        restorer: Restorer,
        setup: JetStreamSetup,
    ) -> None:
        self._host = host
        self._connection = connection
        self._restorer = restorer
        self._setup = setup
        #: Subject of each topic published to lately (checked once).
        self._subjects: dict[str, str] = {}

    def subject(self, topic: str) -> str:
        """The subject of ``topic`` (checked once per topic: a few hundred are kept)."""
        subject = self._subjects.get(topic)
        if subject is None:
            validate_topic(topic)
            self._host.limits.check_topic(topic)
            if len(self._subjects) >= _SUBJECTS_KEPT:
                self._subjects.clear()
            subject = self._subjects[topic] = f"{self._host.prefix}.{topic}"
        return subject

    def messages(self, envelopes: Sequence[Envelope]) -> list[tuple[bytes, dict[str, str]]]:
        """The body and headers of each envelope (for :meth:`send_all`).

        :raises TransportError: when one is larger than the server's ``max_payload``.
        """
        codec, limit = self._host.codec, self._connection.max_payload
        return [envelope_message(envelope, None, codec, limit) for envelope in envelopes]

    async def send_to_group(self, pattern: str, group: str, envelopes: Sequence[Envelope]) -> None:
        """Publish the envelopes for one (pattern, group) only, made if need be."""
        matches = compile_pattern(pattern)
        target = await self._setup.ensure_consumer(pattern, group)
        for envelope in envelopes:
            self.subject(envelope.topic)
            if not matches(envelope.topic):
                raise ConfigurationError(
                    f"envelope {envelope.id} on {envelope.topic!r} cannot reach group "
                    f"{group!r}: its pattern {pattern!r} does not match"
                )
            message = envelope_message(
                envelope, target, self._host.codec, self._connection.max_payload
            )
            await self.send_all(f"{self._host.prefix}.{envelope.topic}", [message])

    async def send_all(
        self,
        subject: str,
        messages: list[tuple[bytes, dict[str, str]]],
        deadline: float | None = None,
    ) -> None:
        """Publish ``messages`` (body, headers) to ``subject`` in one pipelined write;
        return once the stream stored every one, by ``deadline`` (anyio clock; by
        default ``publish_timeout`` from now), or raise :class:`TransportError`."""
        if deadline is None:
            deadline = anyio.current_time() + self._host.publish_timeout
        await self._restorer.wait(subject, deadline)
        connection = self._connection
        publisher = connection.publishing()
        try:
            try:
                # One deadline for the whole publish, a wait for a restore included.
                with anyio.move_on_after(max(deadline - anyio.current_time(), 0.0)) as late:
                    if len(messages) == 1:
                        body, headers = messages[0]
                        await publisher.publish(subject, body, headers)
                    else:
                        await publisher.publish_many(subject, messages)
                if late.cancelled_caught:
                    raise TimeoutError(
                        f"no ack from JetStream within {self._host.publish_timeout:g} s"
                    )
            except NoStreamError:
                await self._publish_without_stream(subject, messages, deadline)
        except connection.errors as error:
            what = f"{len(messages)} envelopes" if len(messages) > 1 else "envelope"
            first = messages[0][1]["Nats-Msg-Id"] if messages else "-"
            raise TransportError(
                f"publish of {what} {first}{'...' if len(messages) > 1 else ''} to "
                f"{subject} was not confirmed: {type(error).__name__}: {error}"
            ) from error

    async def _publish_without_stream(
        self, subject: str, messages: list[tuple[bytes, dict[str, str]]], deadline: float
    ) -> None:
        """No stream answered a publish ("no responders"). Either it is gone (a server
        restarted with an empty store, someone deleted it: the server says so), then it
        is made again with this process's consumers and the publish sent once more (what
        was stored is dropped as a duplicate); or its cluster is electing a leader (no
        answer for a second or two), then the publish is sent again until ``deadline``.

        :raises NoStreamError: when no stream answered by ``deadline``.
        """
        while True:
            if await self._stream_is_gone(deadline):
                logger.warning("NATS: no stream captures %s; making it again", subject)
                await self._restorer.restore()
                await self._connection.publishing().publish_many(subject, messages)
                return
            if anyio.current_time() + _ELECTION_PAUSE >= deadline:
                raise NoStreamError(
                    f"no stream answered for {subject} within {self._host.publish_timeout:g} s "
                    f"(stream {self._host.stream}: its cluster electing a leader, perhaps)"
                )
            await anyio.sleep(_ELECTION_PAUSE)
            try:
                with anyio.fail_after(deadline - anyio.current_time()):
                    await self._connection.publishing().publish_many(subject, messages)
                return
            except NoStreamError:
                continue

    async def _stream_is_gone(self, deadline: float) -> bool:
        """Whether the server says the stream does not exist (asked until ``deadline``,
        at most ``request_timeout``); an answer that does not come is no such news."""
        from nats.js.errors import NotFoundError

        _, js = self._connection.client()
        wait = min(self._host.request_timeout, deadline - anyio.current_time())
        if wait <= 0:
            return False
        try:
            with anyio.move_on_after(wait):
                await js.stream_info(self._host.stream)
        except NotFoundError:
            return True
        except self._connection.errors:
            pass  # no answer (an election), or no connection right now
        return False
