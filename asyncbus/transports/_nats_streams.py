"""What the NATS transport keeps in JetStream: its two streams and each group's consumer.

:class:`JetStreamSetup` makes the stream of envelopes and the stream of dead letters
unless they exist (an existing one is checked: its replicas and subjects must be the
transport's; the dead letters' age and count follow the bus's settings), and makes
(or updates) the durable pull consumer of a (pattern, group). Making them again when
they vanished is :mod:`._nats_restore`'s.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from .._exceptions import ConfigurationError, TransportError
from .._routing import compile_pattern
from ._kit.options import MAX_SECONDS
from ._kit.routes import is_inbox
from ._nats_client import broker_call
from ._nats_groups import GroupDirectory, group_description
from ._nats_subjects import consumer_name

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext

    from .base import TransportSettings

__all__ = ["MIN_MAX_AGE", "JetStreamSetup", "SetupHost"]

#: JetStream's shortest ``max_age`` (seconds): a stream with less is refused.
MIN_MAX_AGE = 0.1


class SetupHost(Protocol):
    """What the setup uses of its transport (:class:`~.nats.NatsTransport`)."""

    prefix: str
    stream: str
    dead_letter_stream: str
    replicas: int
    dedup_window: float
    max_age: float | None
    ack_timeout: float
    inbox_ttl: float
    settings: TransportSettings
    _dead_prefix: str
    _groups: GroupDirectory

    def _client(self) -> tuple[Client, JetStreamContext]:
        """The connected client and its JetStream context."""
        ...

    def check_pattern(self, pattern: str) -> None:
        """:class:`ConfigurationError` unless ``pattern`` fits the transport's limits."""
        ...


def _lacks_peers(error: Exception) -> bool:
    """Whether JetStream refused a stream for want of nodes to hold its replicas."""
    text = str(error).lower()
    return any(word in text for word in ("replica", "insufficient resources", "peers"))


def _fitted(config: Any) -> Any:
    """The stream ``config`` with a duplicate window no longer than its ``max_age``.

    JetStream refuses a window longer than the age ("duplicates window can not be
    larger then max age"), and a stream made with a long age keeps the window it got
    then (2 minutes by default) when its age is shortened: without this, a shorter
    dead-letter TTL could never be applied to an existing stream.
    """
    age = config.max_age or 0.0
    if age > 0 and (config.duplicate_window or 0.0) > age:
        return dataclasses.replace(config, duplicate_window=age)
    return config


def _same(current: Any, wanted: Any) -> bool:
    if isinstance(current, int | float) and isinstance(wanted, int | float):
        return abs(current - wanted) < 1e-3
    return bool(current == wanted)


class JetStreamSetup:
    """The streams and consumers of ``host`` on the server (see the module docstring)."""

    def __init__(self, host: SetupHost) -> None:
        self._host = host

    async def ensure_streams(self, js: JetStreamContext) -> None:
        """Make the stream of envelopes and the stream of dead letters unless they
        exist; apply the bus's dead-letter settings to the second."""
        from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

        host = self._host
        await self._ensure_stream(
            js,
            StreamConfig(
                name=host.stream,
                description=f"asyncbus envelopes, prefix {host.prefix!r}",
                subjects=[f"{host.prefix}.>"],
                retention=RetentionPolicy.INTEREST,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                duplicate_window=host.dedup_window,
                max_age=host.max_age,
                num_replicas=host.replicas,
            ),
            managed=(),
        )
        await self._ensure_stream(
            js,
            StreamConfig(
                name=host.dead_letter_stream,
                description=f"asyncbus dead letters, prefix {host.prefix!r}",
                subjects=[f"{host._dead_prefix}.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                # Within what JetStream takes; the listing drops what is past the TTL.
                max_age=min(max(host.settings.dead_letter_ttl, MIN_MAX_AGE), MAX_SECONDS),
                # 0 means unbounded, as for the bus's DeadLetterQueue.
                max_msgs=max(host.settings.dead_letter_maxlen, 0) or -1,
                num_replicas=host.replicas,
            ),
            managed=("max_age", "max_msgs"),
        )

    async def _ensure_stream(
        self, js: JetStreamContext, config: Any, *, managed: tuple[str, ...]
    ) -> None:
        from nats.errors import NoRespondersError
        from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

        name = config.name
        with broker_call(f"cannot set up the JetStream stream {name}"):
            try:
                info = await js.stream_info(name)
            except (NoRespondersError, ServiceUnavailableError) as error:
                raise TransportError(
                    f"cannot set up the JetStream stream {name}: JetStream did not answer "
                    f"({type(error).__name__}): is it enabled on the server (nats-server "
                    "-js), and is the stream's server up?"
                ) from error
            except NotFoundError:
                try:
                    await js.add_stream(_fitted(config))
                    return
                except Exception as error:
                    try:  # created meanwhile by another process?
                        info = await js.stream_info(name)
                    except NotFoundError:
                        if config.num_replicas > 1 and _lacks_peers(error):
                            raise ConfigurationError(
                                f"JetStream cannot keep stream {name} with "
                                f"replicas={config.num_replicas}: {error} (a cluster needs "
                                "at least that many nodes with JetStream, all up)"
                            ) from error
                        if isinstance(error, APIError) and (error.code or 0) >= 500:
                            raise  # the server failed (a deletion still going on): retry
                        raise ConfigurationError(
                            f"NatsTransport cannot create stream {name} capturing "
                            f"{config.subjects}: {error}"
                        ) from error
            existing = info.config
            if (existing.num_replicas or 1) != config.num_replicas:
                raise ConfigurationError(
                    f"stream {name} exists with {existing.num_replicas or 1} replica(s); this "
                    f"transport asks for replicas={config.num_replicas}: give the count it was "
                    "made with, or change the stream's (nats stream edit) first"
                )
            if set(config.subjects) - set(existing.subjects or ()):
                raise ConfigurationError(
                    f"stream {name} exists but captures {existing.subjects}, not "
                    f"{config.subjects}: another prefix maps to the same stream name"
                )
            changes = {
                field: getattr(config, field)
                for field in managed
                if not _same(getattr(existing, field), getattr(config, field))
            }
            if changes:
                await js.update_stream(_fitted(dataclasses.replace(existing, **changes)))

    async def ensure_consumer(self, pattern: str, group: str) -> str:
        """The group's durable consumer, created (or updated) if need be; its name."""
        await self.make_consumer(pattern, group)
        return consumer_name(pattern, group)

    async def make_consumer(self, pattern: str, group: str) -> bool:
        """Create (or update) the group's consumer if need be; whether it was missing."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        host = self._host
        compile_pattern(pattern)
        host.check_pattern(pattern)
        _, js = host._client()
        name = consumer_name(pattern, group)
        config = ConsumerConfig(
            name=name,
            durable_name=name,
            description=group_description(pattern, group),
            filter_subject=f"{host.prefix}.{pattern}",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=host.ack_timeout,
            deliver_policy=DeliverPolicy.NEW,
            max_deliver=-1,
            max_ack_pending=-1,
            # A request inbox is its process's alone: the server deletes it once
            # nobody pulled from it for inbox_ttl (its process died).
            inactive_threshold=host.inbox_ttl if is_inbox(group) else None,
        )
        with broker_call(f"cannot create consumer {name} on stream {host.stream}"):
            try:
                existing = (await js.consumer_info(host.stream, name)).config
            except NotFoundError:
                existing = None
            # Only a missing consumer, or one with another ack_wait, is created or
            # updated: on a 2.9 server, re-creating a durable pull consumer while naks
            # to it are in flight can lose one and deliver another twice.
            if existing is None or not _same(existing.ack_wait, host.ack_timeout):
                await js.add_consumer(host.stream, config)
        host._groups.add(name, pattern, group)
        return existing is None

    async def consumer_exists(self, name: str) -> bool:
        """Whether the durable consumer ``name`` is on the server (``False``: the server
        says it, or its stream, does not exist).

        :raises TransportError: when the server does not answer (within
            ``request_timeout``) or answers something else.
        """
        from nats.js.errors import NotFoundError

        host = self._host
        _, js = host._client()
        with broker_call(f"cannot read consumer {name}"):
            try:
                await js.consumer_info(host.stream, name)
            except NotFoundError:
                return False
        return True
