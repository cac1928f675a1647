"""The NATS JetStream transport: a stream per prefix, a durable pull consumer per group.

What it keeps on the server, for ``prefix="asyncbus"``:

* stream ``ASYNCBUS`` (interest retention, file storage) captures ``asyncbus.>``.
  Topic ``orders.created`` is published as ``asyncbus.orders.created`` with the
  envelope id as ``Nats-Msg-Id`` (the stream's duplicate window drops a second
  publish of the same id), the envelope's fields as JSON in the ``asyncbus-meta``
  header and the codec's bytes as the body. A message stays until every group whose
  pattern matches it has settled it.
* every (pattern, group) is a durable pull consumer named from both (sanitised, plus
  a hash, so the name is deterministic and unique), described as
  ``asyncbus group ["pattern", "group"]`` (so any process knows the groups a publish
  reaches: :mod:`._nats_groups`), filtering ``asyncbus.{pattern}``,
  with explicit acks, ``ack_wait = ack_timeout``, ``deliver_policy = new`` and no
  delivery limit (the bus's retry policy decides). Every process subscribing with the
  same (pattern, group) pulls from it: competing consumers. Each subscription asks
  for no more than ``prefetch`` minus what it holds, so ``prefetch`` bounds each
  subscription alone (the consumer's own ``max_ack_pending`` is unlimited); the
  pulling side is :mod:`._nats_consumer`.
* stream ``ASYNCBUS_DLQ`` (limits retention, ``max_age = dead_letter_ttl``,
  ``max_msgs = dead_letter_maxlen``, both updated at every start) keeps dead letters,
  one subject per envelope id (``asyncbus_dlq.{id}``). A shorter TTL shrinks its
  duplicate window with it (JetStream refuses a window longer than the age); a TTL
  under JetStream's shortest age (0.1 s) is kept 0.1 s, and the listing drops what is
  past the TTL. Taking one out deletes it by its sequence, the claim that makes a
  replay happen once, and every process hears of what went on
  ``asyncbus_dlq_changes`` (:mod:`._nats_dead_letters`).

Replaying to one group: a server before 2.10 gives a consumer a single filter
subject, so a replay cannot go to a subject only its group sees. It is published
to its topic like any envelope, with the header ``asyncbus-replay-group`` naming
the target consumer; consumers of other groups ack it silently without delivering
it. (It costs them a skip each; it never reaches their handlers.) Its
``Nats-Msg-Id`` is the envelope id plus the replay's timestamp, so the duplicate
window never drops a replay as a copy of the original.

Vanished state: a server restarted with its JetStream store lost, or a stream or
consumer deleted by another client, is made whole again. A publish answered "no
responders" (no stream captures its subject) asks whether the stream exists: when the
server says it does not, the streams are made again, and this process's consumers, then
the publish is sent once more; when it does not say (a cluster electing the stream's
leader answers nothing for a second or two), the publish is sent again every 0.25 s
until ``publish_timeout``, then raises :class:`TransportError`. A pull answered
"consumer deleted" makes the stream and the consumer again, a moment later (a stream
still being deleted would take the new one's files with it), and pulls again. A pull
answered "no responders", or never answered, asks first whether the consumer exists:
only when the server says it does not is it made again; otherwise (a cluster electing
the consumer's leader answers "no responders" too) the pull is asked again after a
pause. Publishes of this process wait while streams and consumers are made again, at
most ``publish_timeout`` (then :class:`TransportError`): one stored before its
consumers exist would reach none of them (retention is by interest). Another process's
groups are made again by that process, on its next pull.

Request inboxes (groups ``_reply.*``, one per bus process) are durable consumers
with ``inactive_threshold = inbox_ttl``: deleted when their subscription ends, and
by the server once their process died and stopped pulling.

Worth knowing:

* A subject travels in the protocol line, which the server holds to 4 KiB (its
  ``max_control_line``) and closes the connection of a longer one: :attr:`limits`
  keeps topics and patterns (which nats-py sends in the subject of the request that
  creates a consumer) within it, and out of whitespace and control characters, and
  the bus refuses the rest at its door. Should the server close the connection for a
  command it refused anyway, the client reconnects as after any lost connection
  (nats-py alone would close for good: :func:`_client_class`).
* ``attempt`` is JetStream's ``num_delivered``: every delivery counts, including
  one a consumer gave back unhandled when it left (the reference transport does not
  count those) and one that timed out at a crashed consumer. A message delivered
  more than ``max_deliveries`` times is handed over with ``error`` set, and the bus
  dead-letters it ``rejected`` instead of running it again; there the deliveries
  given back unhandled (a bus shutting down) do not count: each one is recorded
  in the KV bucket ``{STREAM}_HANDBACKS`` before its ``nak`` (:mod:`._nats_handbacks`).
* After a reconnect every subscription asks again at once: the server may have
  dropped the open pull request (it found no interest while the client was away)
  without answering it. If it did not, the old request may still bring up to one
  more batch, which waits in the subscription (kept in progress) until taken.
* A ``publish`` of many envelopes is one pipelined write: every message is written
  (each with its own reply subject on one shared inbox, :mod:`._nats_publisher`)
  before any stream ack is awaited, and the call returns once the stream acked
  them all. Acks of deliveries are written behind (``ack_nowait``): queued, and
  written together within a moment by one task (:class:`~._kit.AckWriter`), before
  the subscription or the transport closes; a process that dies first gets those
  messages again after ``ack_timeout``. A write of acks (and every nak and term)
  counts once the server answered a ``PING`` sent after it: nats-py buffers what it
  cannot send, so acks written while the server is down or silent are not taken
  for written, and are reported lost when the transport closes without them.
* Order: one subscription receives a topic's envelopes in stream (publish) order;
  ``nack`` and redeliveries after ``ack_timeout`` come back later, out of order.
* Retention is by interest and new groups start with what is published after they
  were created (``deliver_policy = new``), as in the reference transport.
* ``keep_alive=True`` (the default) sends ``+WPI`` (in progress) for held
  deliveries every ``ack_timeout / 3``, so a long handler, a full stage or a retry
  delay never makes the group run a delivery twice; only a dead process loses
  them (a hung one keeps them until it leaves). Without it, a delivery held
  unsettled longer than ``ack_timeout`` goes to the group again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import urlsplit

import anyio

from .._checks import check_count
from .._dead_letters import DeadLetter
from .._envelope import HEADER_REPLAYED, Envelope
from .._exceptions import ConfigurationError, ConnectError, DecodeError, EncodeError, TransportError
from .._groups import GroupInfo
from .._routing import compile_pattern, validate_topic
from ._codec import (
    Codec,
    RawBody,
    dead_letter_from_wire,
    dead_letter_to_wire,
    envelope_to_wire,
)
from ._kit import (
    AckWriter,
    TaskOwner,
    check_url,
    redact,
    require_asyncio,
    require_extra,
    split_urls,
)
from ._kit.options import MAX_SECONDS, checked_prefetch, checked_seconds
from ._kit.redeliveries import DEFAULT_MAX_DELIVERIES, checked_max_deliveries
from ._kit.routes import INBOX_GROUP_PREFIX, unrouted_entry
from ._nats_consumer import (
    HEADER_META,
    HEADER_REPLAY_GROUP,
    PullConsumer,
    broker_call,
)
from ._nats_dead_letters import NatsDeadLetters
from ._nats_dedup import NatsDedupStore
from ._nats_groups import GroupDirectory, group_description, list_groups
from ._nats_handbacks import HandBacks
from ._nats_heartbeats import NatsHeartbeats
from ._nats_leases import NatsLeaseStore
from ._nats_publisher import JetStreamPublisher, NoStreamError
from ._nats_rates import NatsRateStore
from ._registry import registered
from .base import Capabilities, DeadLetterChange, Delivery, TopicLimits, Transport

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext

__all__ = ["HEADER_META", "HEADER_REPLAY_GROUP", "NatsTransport", "consumer_name"]

logger = logging.getLogger("asyncbus.transport.nats")

#: The URL schemes nats-py takes, and what a URL looks like (for errors).
_SCHEMES = tuple(registered("nats").schemes)
#: The most copies JetStream keeps of a stream.
_MAX_REPLICAS = 5
_URL_FORM = "nats://[user:password@]host:port (tls://, ws:// or wss:// also)"

#: Header of a dead-letter message telling how its body holds the payload.
_HEADER_BODY = "asyncbus-body"
_HEADER_DEAD_LETTER = "asyncbus-dead-letter"

#: A pull request lives this long on the server (then it answers 408 and we ask again),
#: or less with a short ack_timeout (see :meth:`NatsTransport.pull_expires`).
_PULL_EXPIRES = 5.0
#: Topics whose subject is kept checked (then the cache starts over).
_SUBJECTS_KEPT = 512
#: Seconds between two publishes that no stream answered while its cluster elects.
_ELECTION_PAUSE = 0.25
#: Seconds closing the connection may take (past the close deadline too: it is local).
_CLOSE_TIMEOUT = 0.5
#: Seconds the ack writer waits for more acks before writing them together.
_ACK_LINGER = 0.002
#: JetStream's shortest ``max_age`` (seconds): a stream with less is refused.
_MIN_MAX_AGE = 0.1

#: The server's longest protocol line (its default ``max_control_line``): a command
#: longer than that (a publish to a longer subject) makes it close the connection.
_CONTROL_LINE = 4096
#: Room kept on that line for what surrounds a subject (verb, reply subject, sizes).
_LINE_ROOM = 256
#: Longest durable consumer name (:func:`consumer_name`).
_NAME_MAX = 48 + 1 + 32 + 1 + 12

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_SAFE_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: What a NATS subject cannot hold: the protocol splits on whitespace.
_NOT_IN_SUBJECT_CLASS = r"[\s\x00-\x1f\x7f]"
_NOT_IN_SUBJECT = re.compile(_NOT_IN_SUBJECT_CLASS)


def consumer_name(pattern: str, group: str) -> str:
    """The durable consumer of (pattern, group): readable, deterministic and unique."""
    digest = hashlib.sha256(f"{pattern}\x00{group}".encode()).hexdigest()[:12]
    return f"{_UNSAFE.sub('_', group)[:48]}-{_UNSAFE.sub('_', pattern)[:32]}-{digest}"


def _id_token(envelope_id: str) -> str:
    """A subject token for an envelope id (ids that are not one are hashed)."""
    if _SAFE_ID.fullmatch(envelope_id):
        return envelope_id
    return "h" + hashlib.sha256(envelope_id.encode()).hexdigest()[:40]


def _check_subject_text(kind: str, text: str) -> None:
    if _NOT_IN_SUBJECT.search(text):
        raise ConfigurationError(
            f"{kind} {text!r} cannot be a NATS subject: no whitespace or control characters"
        )


def _subject_limits(prefix: str, stream: str) -> TopicLimits:
    """What topics and patterns fit in NATS subjects under ``prefix``.

    A topic is published to ``{prefix}.{topic}``; a pattern becomes a consumer's filter
    subject, which nats-py sends in the subject of the request that creates it
    (``$JS.API.CONSUMER.CREATE.{stream}.{name}.{prefix}.{pattern}``). Either must fit
    in the server's protocol line with what surrounds it: a longer one makes the server
    close the connection.
    """
    room = _CONTROL_LINE - _LINE_ROOM - len(prefix.encode()) - 1
    return TopicLimits(
        max_topic_bytes=room,
        max_pattern_bytes=room - len(f"$JS.API.CONSUMER.CREATE.{stream}.".encode()) - _NAME_MAX - 1,
        forbidden=_NOT_IN_SUBJECT_CLASS,
        why=(
            "a NATS subject holds no whitespace or control character and fits, with its "
            f"prefix {prefix!r}, in the server's {_CONTROL_LINE}-byte protocol line"
        ),
    )


def _lacks_peers(error: Exception) -> bool:
    """Whether JetStream refused a stream for want of nodes to hold its replicas."""
    text = str(error).lower()
    return any(word in text for word in ("replica", "insufficient resources", "peers"))


def _address(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        port = parts.port or 4222
    except ValueError:
        return parts.netloc.rpartition("@")[2]
    return f"{parts.hostname or '127.0.0.1'}:{port}"


def _ascii_json(data: bytes) -> str:
    """The same JSON document with every non-ASCII character escaped."""
    return json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=True)


def _header_size(headers: Mapping[str, str]) -> int:
    # "NATS/1.0\r\n" + "name: value\r\n"... + "\r\n"
    return 12 + sum(len(name) + len(value.encode()) + 4 for name, value in headers.items())


class NatsTransport(Transport):
    """Envelopes in a NATS JetStream stream; groups are durable pull consumers.

    Runs on asyncio only (nats-py is asyncio-only). The server needs JetStream; a
    2.9 server is enough. See the module docstring for what is kept on the server.

    :param url: the server, ``nats://[user:password@]host:port``; or the nodes of one
        cluster, as a list or one string separated by commas: the client connects to
        any that answers and, after a lost connection, to any listed or discovered
        (the servers announce their peers).
    :param replicas: copies JetStream keeps of the bus's streams and key-value buckets
        (1 to 5; a cluster needs at least as many nodes). An existing stream with
        another count is an error at connect, never reused with other guarantees.
    :param prefix: subject prefix and (upper-cased, sanitised) stream name; one bus
        deployment per prefix.
    :param ack_timeout: seconds a delivery may stay unsettled by a consumer that
        stopped answering (crashed) before the group gets it again (``ack_wait``).
    :param codec: how payloads become bytes.
    :param connect_timeout: seconds to wait for the first connection.
    :param request_timeout: seconds to wait for the server to answer an API request.
    :param publish_timeout: longest a ``publish`` waits for the stream's ack before
        raising :class:`TransportError` (default: ``request_timeout``); a publish that
        timed out may or may not be stored.
    :param dedup_window: seconds the stream remembers envelope ids to drop duplicates
        (capped at ``max_age``: JetStream refuses a longer window).
    :param max_age: seconds after which the stream discards envelopes still unsettled
        (``None``: keep them until every group settled them; at least 0.1 s).
    :param keep_alive: while a delivery is held (queued in its stage, handled,
        waiting for a retry), tell the server every ``ack_timeout / 3`` that it is in
        progress, so a long handler or retry delay is never run twice; off, a delivery
        held longer than ``ack_timeout`` also goes to another consumer.
    :param reconnect_wait: seconds between reconnection attempts after a connection
        broke (reconnection is nats-py's and never gives up).
    :param max_deliveries: deliveries of one message (``num_delivered``), none
        settled, after which the next one is handed over with ``error`` set (the bus
        dead-letters it ``rejected``).
    :raises ConfigurationError: for a URL without a scheme, with another broker's or
        the web's (not ``nats``, ``tls``, ``ws``, ``wss``) or with a bad port, a bad
        prefix, or a timeout, window or cap that is not a positive number in range
        (NaN, infinities, bools, huge values included).
    :raises ImportError: (also a ``ConnectError`` and a ``ConfigurationError``) when
        nats-py is not installed: the message names the extra.
    """

    #: Seconds without a pull after which the server deletes a request inbox's
    #: consumer (its process died; one that leaves deletes it at once).
    inbox_ttl: float = 300.0

    capabilities: ClassVar[Capabilities] = Capabilities(
        delayed_nack=True,
        dedup=True,
        per_message_ttl=False,
        replay=True,
        durable=True,
        ordered=True,
    )
    name: ClassVar[str] = "nats"
    #: Every publish awaits the broker's confirmation (the call's one yield).
    publish_waits: ClassVar[bool] = True

    def __init__(
        self,
        url: str | Sequence[str] = "nats://127.0.0.1:4222",
        *,
        prefix: str = "asyncbus",
        ack_timeout: float = 30.0,
        codec: Codec | None = None,
        connect_timeout: float = 2.0,
        request_timeout: float = 5.0,
        dedup_window: float = 120.0,
        max_age: float | None = None,
        keep_alive: bool = True,
        reconnect_wait: float = 0.5,
        max_deliveries: int = DEFAULT_MAX_DELIVERIES,
        publish_timeout: float | None = None,
        replicas: int = 1,
    ) -> None:
        super().__init__(codec=codec)
        require_extra("NatsTransport", "nats", "nats")
        check_url("NatsTransport", url, _SCHEMES, _URL_FORM)
        check_count(replicas, "NatsTransport: replicas", 1, _MAX_REPLICAS)
        if publish_timeout is None:
            publish_timeout = request_timeout
        validate_topic(prefix)
        _check_subject_text("prefix", prefix)
        seconds = {
            label: checked_seconds(value, f"NatsTransport: {label}")
            for label, value in (
                ("ack_timeout", ack_timeout),
                ("connect_timeout", connect_timeout),
                ("request_timeout", request_timeout),
                ("dedup_window", dedup_window),
                ("reconnect_wait", reconnect_wait),
                ("publish_timeout", publish_timeout),
            )
        }
        if max_age is not None:
            max_age = checked_seconds(max_age, "NatsTransport: max_age")
            if max_age < _MIN_MAX_AGE:
                raise ConfigurationError(
                    f"NatsTransport: max_age must be at least {_MIN_MAX_AGE:g} s "
                    f"(JetStream's shortest), got {max_age!r}"
                )
        if not isinstance(keep_alive, bool):
            raise ConfigurationError(
                f"NatsTransport: keep_alive must be a bool, got {keep_alive!r}"
            )
        #: Every URL given, in order (the nodes of one cluster, or one server).
        self.servers = split_urls(url)
        #: The URLs given, comma-separated.
        self.url = ",".join(self.servers)
        self.replicas = replicas
        self.prefix = prefix
        self.ack_timeout = seconds["ack_timeout"]
        self.connect_timeout = seconds["connect_timeout"]
        self.request_timeout = seconds["request_timeout"]
        self.publish_timeout = seconds["publish_timeout"]
        self.dedup_window = seconds["dedup_window"]
        self.max_age = max_age
        self.keep_alive = keep_alive
        self.reconnect_wait = seconds["reconnect_wait"]
        self.max_deliveries = checked_max_deliveries(max_deliveries)
        #: Name of the stream of envelopes, and of the stream of dead letters.
        self.stream = _UNSAFE.sub("_", prefix).upper()
        self.dead_letter_stream = f"{self.stream}_DLQ"
        self.limits = _subject_limits(prefix, self.stream)
        if (self.limits.max_pattern_bytes or 0) < 1:
            raise ConfigurationError(
                f"NatsTransport: prefix of {len(prefix.encode())} bytes leaves no room for "
                "a topic in a NATS subject"
            )
        self._dead_prefix = f"{prefix}_dlq"
        self._shared_dead = NatsDeadLetters(self, self._dead_prefix)
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._consumers: set[PullConsumer] = set()
        #: The background tasks: publish expiry, keep-alives, and what outlives a
        #: subscription (an inbox kept until its open pull request ends).
        self._tasks = TaskOwner("NatsTransport")
        self._server: str | None = None
        self._publishes: JetStreamPublisher | None = None
        #: Times the streams and consumers were made again (see :meth:`_restore`).
        self._restores = 0
        self._restore_lock = anyio.Lock()
        self._groups = GroupDirectory(self.stream)
        self._handbacks = HandBacks(self)
        self._heartbeats = NatsHeartbeats(self)
        #: What a broker call may raise (nats-py's errors are added once it is imported).
        self._errors: tuple[type[BaseException], ...] = (TimeoutError, OSError)
        #: Subject of each topic published to lately (checked once).
        self._subjects: dict[str, str] = {}
        #: The server's max_payload (read at connect).
        self._max_payload = 1 << 20
        #: Acks written behind, by consumer name: the reply subjects to ``+ACK``.
        self._acks = AckWriter[str, str](
            "NatsTransport",
            self._write_acks,
            self.cleanup_scope,
            linger=_ACK_LINGER,
            timeout=self.request_timeout,
        )

    def __repr__(self) -> str:
        return f"NatsTransport({self._shown()!r}, prefix={self.prefix!r})"

    def _shown(self) -> str:
        """The URLs given, credentials hidden."""
        return ",".join(redact(one) for one in self.servers)

    def _where(self) -> str:
        """The server connected to now (the first listed before any connection)."""
        nc = self._nc
        connected = nc.connected_url if nc is not None else None
        if connected is not None:
            return f"{connected.hostname}:{connected.port}"
        return _address(self.servers[0])

    @property
    def pull_expires(self) -> float:
        """Seconds each pull request lives on the server: 5, or ``ack_timeout / 2``.

        A process that dies leaves its open pull request behind until it expires, and
        the server goes on sending into it: a redelivery sent there is lost, yet
        counted in ``num_delivered``, so a message that kills its consumer would
        reach ``max_deliveries`` early (and miss its next consumer until one more
        ``ack_timeout``). A request that expires within half an ``ack_timeout`` is
        gone before a redelivery of what its process held comes due (``+WPI`` keeps
        them at least two thirds of an ``ack_timeout`` away).
        """
        return min(_PULL_EXPIRES, self.ack_timeout / 2)

    # -- connection ---------------------------------------------------------------

    async def __aenter__(self) -> NatsTransport:
        await self.connect()
        return self

    async def connect(self) -> None:
        """Connect, and create the two streams unless they exist.

        :raises ConnectError: when nats-py is missing, the server is unreachable or
            JetStream is not enabled on it.
        """
        if self._nc is not None:
            return
        try:
            from nats.errors import Error as NatsError

            client_class = _client_class()
        except ImportError as error:
            raise ConnectError(
                "NatsTransport needs the 'nats' extra: pip install 'asyncbus[nats]'"
            ) from error
        require_asyncio("NatsTransport", "nats-py")
        addresses = ", ".join(_address(one) for one in self.servers)
        where = f"NATS at {addresses} ({self._shown()})"
        options: dict[str, Any] = {
            "name": f"asyncbus {self.prefix}",
            "connect_timeout": self.connect_timeout,
            # The first connection is tried twice (a refused one is retried once),
            # all within connect_timeout; once connected, reconnection never gives up
            # (set below).
            "allow_reconnect": True,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": self.reconnect_wait,
            "error_cb": self._on_error,
            "disconnected_cb": self._on_disconnected,
            "reconnected_cb": self._on_reconnected,
            "closed_cb": self._on_closed,
        }
        self._errors = (NatsError, TimeoutError, OSError)
        nc = client_class()
        js = nc.jetstream(timeout=self.request_timeout)
        publisher = JetStreamPublisher(nc, self.publish_timeout)
        self._groups.forget()
        try:
            try:
                # nats-py gives each attempt connect_timeout; all of them get it together.
                with anyio.fail_after(self.connect_timeout):
                    await nc.connect(self.servers, **options)
            except Exception as error:
                reason = f"{type(error).__name__}: {error}"
                if isinstance(error, TimeoutError) and not str(error):
                    reason = f"no connection within connect_timeout={self.connect_timeout:g} s"
                raise ConnectError(f"NatsTransport cannot connect to {where}: {reason}") from error
            nc.options["max_reconnect_attempts"] = -1
            self._server = _server_id(nc)
            await self._tasks.open()
            await self._ensure_streams(js)
            await publisher.start(self._tasks)
            await self._groups.watch(nc)
        except BaseException as error:  # deliberate: close the connection on any way out
            try:
                # Outside any scope of its own: a task group's scope must be left where
                # it was entered (inside a new one, anyio raises RuntimeError).
                await self._tasks.aclose()
            finally:
                with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_TIMEOUT):
                    await publisher.stop()
                    if not nc.is_connected:
                        _close_failed_attempt(nc)  # an attempt cut short keeps its socket
                    with contextlib.suppress(Exception):
                        await nc.close()
            if isinstance(error, ConnectError) or not isinstance(error, Exception):
                raise
            if isinstance(error, ConfigurationError):
                raise ConfigurationError(f"NatsTransport on {where}: {error}") from error
            raise ConnectError(
                f"NatsTransport on {where} cannot be set up: {type(error).__name__}: {error}"
                if not isinstance(error, TransportError)
                else f"NatsTransport on {where}: {error}"
            ) from error
        self._nc, self._js, self._publishes = nc, js, publisher
        self._max_payload = nc.max_payload
        self._acks.open()
        self._tasks.start_soon(self._acks.run, name="asyncbus NATS ack writer")

    async def _ensure_streams(self, js: JetStreamContext) -> None:
        from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

        await self._ensure_stream(
            js,
            StreamConfig(
                name=self.stream,
                description=f"asyncbus envelopes, prefix {self.prefix!r}",
                subjects=[f"{self.prefix}.>"],
                retention=RetentionPolicy.INTEREST,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                duplicate_window=self.dedup_window,
                max_age=self.max_age,
                num_replicas=self.replicas,
            ),
            managed=(),
        )
        await self._ensure_stream(
            js,
            StreamConfig(
                name=self.dead_letter_stream,
                description=f"asyncbus dead letters, prefix {self.prefix!r}",
                subjects=[f"{self._dead_prefix}.>"],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                discard=DiscardPolicy.OLD,
                # Within what JetStream takes; the listing drops what is past the TTL.
                max_age=min(max(self.settings.dead_letter_ttl, _MIN_MAX_AGE), MAX_SECONDS),
                # 0 means unbounded, as for the bus's DeadLetterQueue.
                max_msgs=max(self.settings.dead_letter_maxlen, 0) or -1,
                num_replicas=self.replicas,
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

    async def aclose(self) -> None:
        """Write the acks queued, flush what is buffered (acks, naks) and close the
        connection, shielded."""
        if self._nc is None:
            return
        with self.cleanup_scope(self.request_timeout):
            try:
                await self._acks.flush()
            except Exception as error:
                logger.warning("NATS: acks lost at close (redelivered later): %s", error)
        nc, self._nc, self._js = self._nc, None, None
        publisher, self._publishes = self._publishes, None
        if nc is None:
            return
        for consumer in list(self._consumers):
            if consumer.closed:  # lingering: stop waiting, unsubscribe now
                consumer.request = None
                consumer.wake()
        # Keep-alives stop; lingering inboxes unsubscribe (shielded, by the deadline).
        # Whatever interrupts that (a cancellation of the closing task), the connection
        # is closed below all the same: never a socket left open.
        try:
            await self._tasks.aclose()
        finally:
            # What is still queued (a write cut short puts its acks back) is lost.
            self._acks.close()
            await self._close_connection(nc, publisher)

    async def _close_connection(self, nc: Any, publisher: Any) -> None:
        """Flush (by the deadline), stop the publisher and close ``nc`` (shielded)."""
        with self.cleanup_scope():
            try:
                with anyio.move_on_after(self.request_timeout):
                    await nc.flush(timeout=self.request_timeout)
            except Exception:
                logger.debug("flush before close failed", exc_info=True)
        with anyio.CancelScope(shield=True):
            if publisher is not None:
                await publisher.stop()
            # Closing the socket is local and quick; it runs even past the deadline,
            # bounded, so no connection is left open.
            with anyio.move_on_after(_CLOSE_TIMEOUT):
                try:
                    await nc.close()
                except Exception:
                    logger.debug("close failed", exc_info=True)
            for consumer in list(self._consumers):
                consumer.wake()

    async def _on_error(self, error: Exception) -> None:
        nc = self._nc
        if nc is None:
            return  # connecting (connect() reports it) or closing
        if nc.is_connecting or nc.is_reconnecting:  # an attempt to reconnect failed
            _close_failed_attempt(nc)
        logger.warning("NATS %s: %s: %s", self._where(), type(error).__name__, error)

    async def _on_disconnected(self) -> None:
        if self._nc is None:
            return  # our own aclose()
        logger.warning("NATS %s: disconnected, reconnecting", self._where())

    async def _on_reconnected(self) -> None:
        logger.info("NATS %s: reconnected", self._where())
        self._groups.forget()  # announcements may have been missed meanwhile
        self._shared_dead.reconnected()  # so may changes of the dead letters
        self._server = _server_id(self._nc)
        if self._nc is not None:
            self._max_payload = self._nc.max_payload
        # The open pull requests may be gone: a restarted server forgot them, and the
        # same server drops one whose inbox had no interest while we were away (then
        # nothing answers it before its expiry). Ask again at once rather than wait
        # for that: if the old request is still alive, it may bring up to one more
        # batch, which waits in ``ready`` (kept in progress like the rest).
        for consumer in list(self._consumers):
            if not consumer.closed:
                consumer.request = None
                consumer.pause_until = 0.0
                consumer.wake()

    async def _on_closed(self) -> None:
        for consumer in list(self._consumers):
            consumer.wake()

    async def _write_acks(self, batch: dict[str, list[tuple[str, str | None]]]) -> list[str]:
        """``+ACK`` the queued deliveries (the AckWriter's ``write``): each one a message
        to its reply subject, buffered by nats-py and sent in one write.

        :returns: the consumers whose acks are lost for good (the connection is
            closed: the server delivers those messages again after ``ack_timeout``).
        """
        nc = self._nc
        if nc is None or nc.is_closed:
            return list(batch)
        publish = nc.publish
        reconnects = nc.stats["reconnects"]
        written: list[str] = []
        try:
            for name, acks in batch.items():
                for reply, _envelope_id in acks:
                    await publish(reply)
                written.append(name)
        except self._errors as error:
            # Closed meanwhile: the rest is lost (written again, an ack is harmless).
            logger.debug("NATS: writing acks failed: %s", error)
            return [name for name in batch if name not in written]
        await self._confirm(nc, reconnects, "writing acks")
        return []

    async def _confirm(self, nc: Client, reconnects: int, doing: str) -> None:
        """Wait until the server has what was written on ``nc`` so far (one round trip).

        nats-py returns from a publish once the bytes are buffered, and buffers them
        while it is disconnected: without this, an ack, nak or term written to a broker
        that is down or silent would count as taken. Written before a reconnect
        (``reconnects``, nats-py's count then), the bytes may have died with the old
        socket, so they are not confirmed either.

        :raises TransportError: when the server did not answer within
            ``request_timeout`` (an ack is harmless to write again), or the connection
            was lost meanwhile.
        """
        if nc.is_connected:  # (while reconnecting, nats-py's flush sends no ping)
            with broker_call(f"NATS: {doing}: the server did not confirm"):
                await nc.flush(timeout=self.request_timeout)  # type: ignore[arg-type]
        if not nc.is_connected or nc.stats["reconnects"] != reconnects:
            raise TransportError(f"NATS: {doing}: the connection was lost before it was confirmed")

    def unsettled_acks(self) -> list[tuple[str, str]]:
        """(stage name, envelope id) of the acks the transport closed without writing."""
        return self._acks.take_lost()

    def _publisher(self) -> JetStreamPublisher:
        if self._publishes is None:
            raise TransportError("NatsTransport is not connected: use `async with transport:`")
        return self._publishes

    def _client(self) -> tuple[Client, JetStreamContext]:
        if self._nc is None or self._js is None:
            raise TransportError("NatsTransport is not connected: use `async with transport:`")
        return self._nc, self._js

    # -- publishing ---------------------------------------------------------------

    def check_topic(self, topic: str) -> None:
        """:class:`ConfigurationError` unless ``topic`` makes a subject the server takes
        (:attr:`limits`; checked once per topic)."""
        self._subject(topic)

    def _subject(self, topic: str) -> str:
        """The subject of ``topic`` (checked once per topic: a few hundred are kept)."""
        subject = self._subjects.get(topic)
        if subject is None:
            validate_topic(topic)
            self.limits.check_topic(topic)
            if len(self._subjects) >= _SUBJECTS_KEPT:
                self._subjects.clear()
            subject = self._subjects[topic] = f"{self.prefix}.{topic}"
        return subject

    async def publish(self, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Publish each envelope to ``{prefix}.{topic}`` and wait for the stream's ack.

        :raises ConfigurationError: when ``topic`` is not a valid NATS subject.
        :raises TransportError: when the server refuses or does not confirm in time,
            or an envelope is larger than the server's ``max_payload``.
        """
        subject = self._subject(topic)
        message = self._message
        await self._send_all(subject, [message(envelope, None) for envelope in envelopes])

    async def publish_routed(
        self, topic: str, envelopes: Sequence[Envelope]
    ) -> tuple[str, ...] | None:
        """:meth:`publish` to the groups the stream's consumers are; none: dead-letter.

        The groups are the stream's durable consumers (every process's), read from the
        server and read again when it announces a change. When none matches ``topic``
        they are read once more (one created a moment ago counts), and if still none
        does, each envelope is stored as a ``no_subscribers`` dead letter, unpublished.

        :returns: the stage names of the groups reached (``()``: none).
        """
        subject = self._subject(topic)  # (checks the topic)
        await self._wait_for_restore(subject)
        names = self._groups.known(topic)
        if not names:
            await self._read_groups()
            names = self._groups.known(topic)
        if not names and any(
            compile_pattern(mine.pattern)(topic) for mine in self._consumers if not mine.closed
        ):
            # This process subscribes to it, yet the server has no such consumer: it
            # lost them (a restart with an empty store). Make them again, then look.
            await self._restore()
            await self._read_groups()
            names = self._groups.known(topic)
        if not names:
            for envelope in envelopes:
                await self.add_dead_letter(unrouted_entry(envelope))
            return ()
        changes = self._groups.changes
        await self.publish(topic, envelopes)
        if self._groups.changes != changes:
            # The server announced a consumer created or deleted while the publish was on
            # its way: the announcement of one made before the publish was stored comes
            # before its acknowledgement, so the groups known now are those it reached.
            # (None found now: it went to those that were there, it is not a dead letter.)
            if self._groups.known(topic) is None:
                await self._read_groups()
            names = self._groups.known(topic) or names
        return names

    async def _read_groups(self) -> None:
        """Read the groups (the stream's consumers) again; make a vanished stream again."""
        from nats.js.errors import NotFoundError

        _, js = self._client()
        with broker_call(f"cannot list the consumers of stream {self.stream}"):
            try:
                await self._groups.read(js, self.prefix)
            except NotFoundError:
                # The server lost its state, or someone deleted the stream: make it
                # again with this process's consumers, then look.
                logger.warning("NATS: stream %s is gone; making it again", self.stream)
                await self._restore()
                await self._groups.read(js, self.prefix)

    async def publish_to_group(
        self, pattern: str, group: str, envelopes: Sequence[Envelope]
    ) -> None:
        """Deliver the envelopes to one (pattern, group) only (see the module docstring)."""
        matches = compile_pattern(pattern)
        target = await self._ensure_consumer(pattern, group)
        for envelope in envelopes:
            self.check_topic(envelope.topic)
            if not matches(envelope.topic):
                raise ConfigurationError(
                    f"envelope {envelope.id} on {envelope.topic!r} cannot reach group "
                    f"{group!r}: its pattern {pattern!r} does not match"
                )
            await self._send(f"{self.prefix}.{envelope.topic}", envelope, target)

    async def _send(self, subject: str, envelope: Envelope, target: str | None) -> None:
        await self._send_all(subject, [self._message(envelope, target)])

    def _message(self, envelope: Envelope, target: str | None) -> tuple[bytes, dict[str, str]]:
        """The body and headers of ``envelope`` on the wire (for group ``target`` only,
        a replay, when given).

        :raises TransportError: when it is larger than the server's ``max_payload``.
        """
        meta, body = envelope_to_wire(envelope, self.codec)
        msg_id = envelope.id
        if target is not None or HEADER_REPLAYED in envelope.headers:
            # A replay reuses the envelope id; it must not be dropped as a duplicate
            # of the original (or of another replay of it).
            msg_id = f"{envelope.id}:{target or ''}:{envelope.timestamp!r}"
        if "\r" in msg_id or "\n" in msg_id:
            msg_id = msg_id.replace("\r", " ").replace("\n", " ")
        # Header values must be ASCII for every nats-py (up to 2.14 a non-ASCII value
        # loses the whole header block): escape what msgspec wrote as UTF-8.
        headers = {
            "Nats-Msg-Id": msg_id,
            HEADER_META: meta.decode() if meta.isascii() else _ascii_json(meta),
        }
        if target is not None:
            headers[HEADER_REPLAY_GROUP] = target
        limit = self._max_payload
        # (A UTF-8 character is at most 4 bytes: most messages are surely small enough.)
        if len(body) + 4 * (len(msg_id) + len(headers[HEADER_META])) + 256 > limit:
            size = len(body) + _header_size(headers)
            if size > limit:
                raise TransportError(
                    f"envelope {envelope.id} is {size} bytes on the wire, over the NATS "
                    f"server's max_payload of {limit} bytes"
                )
        return body, headers

    async def _send_all(self, subject: str, messages: list[tuple[bytes, dict[str, str]]]) -> None:
        """Publish ``messages`` (body, headers) to ``subject`` in one pipelined write;
        return once the stream stored every one."""
        deadline = anyio.current_time() + self.publish_timeout
        await self._wait_for_restore(subject)
        publisher = self._publisher()
        try:
            try:
                if len(messages) == 1:
                    body, headers = messages[0]
                    await publisher.publish(subject, body, headers)
                else:
                    await publisher.publish_many(subject, messages)
            except NoStreamError:
                await self._publish_without_stream(subject, messages, deadline)
        except self._errors as error:
            what = f"{len(messages)} envelopes" if len(messages) > 1 else "envelope"
            first = messages[0][1]["Nats-Msg-Id"] if messages else "-"
            raise TransportError(
                f"publish of {what} {first}{'...' if len(messages) > 1 else ''} to "
                f"{subject} was not confirmed: {type(error).__name__}: {error}"
            ) from error

    async def _wait_for_restore(self, subject: str) -> None:
        """Wait, at most ``publish_timeout``, while another task makes the streams and
        consumers again (:meth:`_restore`): a publish stored before this process's
        consumers exist would reach none of them (retention is by interest).

        :raises TransportError: when that is not done within ``publish_timeout``.
        """
        if not self._restore_lock.locked():
            return
        with anyio.move_on_after(self.publish_timeout) as waited:
            async with self._restore_lock:
                pass
        if waited.cancelled_caught:
            raise TransportError(
                f"publish to {subject} was not confirmed: the stream {self.stream} is "
                f"being made again (not done within {self.publish_timeout:g} s)"
            )

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
                await self._restore()
                await self._publisher().publish_many(subject, messages)
                return
            if anyio.current_time() + _ELECTION_PAUSE >= deadline:
                raise NoStreamError(
                    f"no stream answered for {subject} within {self.publish_timeout:g} s "
                    f"(stream {self.stream}: its cluster electing a leader, perhaps)"
                )
            await anyio.sleep(_ELECTION_PAUSE)
            try:
                with anyio.fail_after(deadline - anyio.current_time()):
                    await self._publisher().publish_many(subject, messages)
                return
            except NoStreamError:
                continue

    async def _stream_is_gone(self, deadline: float) -> bool:
        """Whether the server says the stream does not exist (asked until ``deadline``,
        at most ``request_timeout``); an answer that does not come is no such news."""
        from nats.js.errors import NotFoundError

        _, js = self._client()
        wait = min(self.request_timeout, deadline - anyio.current_time())
        if wait <= 0:
            return False
        try:
            with anyio.move_on_after(wait):
                await js.stream_info(self.stream)
        except NotFoundError:
            return True
        except self._errors:
            pass  # no answer (an election), or no connection right now
        return False

    # -- consuming ----------------------------------------------------------------

    async def _ensure_consumer(self, pattern: str, group: str) -> str:
        """The group's durable consumer, created (or updated) if need be; its name."""
        await self._make_consumer(pattern, group)
        return consumer_name(pattern, group)

    async def _make_consumer(self, pattern: str, group: str) -> bool:
        """Create (or update) the group's consumer if need be; whether it was missing."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        compile_pattern(pattern)
        self.check_pattern(pattern)
        _, js = self._client()
        name = consumer_name(pattern, group)
        config = ConsumerConfig(
            name=name,
            durable_name=name,
            description=group_description(pattern, group),
            filter_subject=f"{self.prefix}.{pattern}",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_timeout,
            deliver_policy=DeliverPolicy.NEW,
            max_deliver=-1,
            max_ack_pending=-1,
            # A request inbox is its process's alone: the server deletes it once
            # nobody pulled from it for inbox_ttl (its process died).
            inactive_threshold=self.inbox_ttl if _is_inbox(group) else None,
        )
        with broker_call(f"cannot create consumer {name} on stream {self.stream}"):
            try:
                existing = (await js.consumer_info(self.stream, name)).config
            except NotFoundError:
                existing = None
            # Only a missing consumer, or one with another ack_wait, is created or
            # updated: on a 2.9 server, re-creating a durable pull consumer while naks
            # to it are in flight can lose one and deliver another twice.
            if existing is None or not _same(existing.ack_wait, self.ack_timeout):
                await js.add_consumer(self.stream, config)
        self._groups.add(name, pattern, group)
        return existing is None

    @asynccontextmanager
    async def subscribe(
        self, pattern: str, *, group: str, prefetch: int
    ) -> AsyncIterator[AsyncIterator[Delivery]]:
        """Pull from the group's durable consumer; unsettled deliveries go back at the end."""
        checked_prefetch(prefetch)
        nc, _ = self._client()
        await self._ensure_consumer(pattern, group)
        consumer = PullConsumer(self, nc, consumer_name(pattern, group), pattern, group, prefetch)
        with broker_call(f"cannot subscribe to {consumer.inbox}"):
            subscription = await nc.subscribe(f"{consumer.inbox}.*", cb=consumer.on_message)
        self._consumers.add(consumer)
        try:
            if self.keep_alive:
                self._tasks.start_soon(consumer.keep_alive)
            yield consumer
        finally:
            with self.cleanup_scope():
                try:  # what was acked is written before the rest goes back
                    await self._acks.flush([consumer.name])
                except Exception as error:
                    logger.warning("NATS: acks of %s not written yet: %s", consumer.name, error)
                if _is_inbox(group):
                    await self._drop_inbox(consumer, subscription)
                elif await consumer.release(subscription):
                    self._consumers.discard(consumer)
                else:
                    self._tasks.start_soon(consumer.linger, subscription)

    async def _drop_inbox(self, consumer: PullConsumer, subscription: Subscription) -> None:
        """Delete a leaving request inbox's consumer (what it holds is moot, its process
        leaves); a consumer left behind by a process that died goes after
        ``inbox_ttl`` without pulls (``inactive_threshold``)."""
        from nats.js.errors import NotFoundError

        consumer.closed = True
        consumer.unsettled.clear()
        consumer.ready.clear()
        self._consumers.discard(consumer)
        try:
            with anyio.move_on_after(self.request_timeout):
                await consumer._unsubscribe(subscription)
                if not consumer.nc.is_closed and self._js is not None:
                    with contextlib.suppress(NotFoundError):
                        await self._js.delete_consumer(self.stream, consumer.name)
        except Exception as error:  # it expires anyway
            logger.warning(
                "NATS: deleting inbox consumer %s failed (it expires within %g s): %s",
                consumer.name,
                self.inbox_ttl,
                error,
            )

    async def _restore(self, consumer: PullConsumer | None = None) -> None:
        """Make the streams again if they are gone, then the consumers of this
        transport's subscriptions (``consumer`` first), so publishes are stored and
        reach the groups of this process again.

        One task at a time does it; the others wait for it and return.
        """
        generation = self._restores
        async with self._restore_lock:
            if self._restores != generation and (consumer is None or consumer.failure is None):
                return  # made again meanwhile by another task
            _, js = self._client()
            await self._ensure_streams(js)
            others = [c for c in self._consumers if c is not consumer and not c.closed]
            for each in ([consumer] if consumer is not None else []) + others:
                made = await self._make_consumer(each.pattern, each.group)
                if each is not consumer and (made or each.failure is not None):
                    # Its open pull request was for the consumer that vanished.
                    each.failure = None
                    each.request = None
                    each.wake()
            self._restores += 1

    async def _consumer_exists(self, name: str) -> bool:
        from nats.js.errors import NotFoundError

        _, js = self._client()
        with broker_call(f"cannot read consumer {name}"):
            try:
                await js.consumer_info(self.stream, name)
            except NotFoundError:
                return False
        return True

    def dedup_store(self, window: float) -> NatsDedupStore:
        """``deduplicate()``'s store in NATS: a JetStream KV bucket aged by ``window``.

        (The stream's ``Nats-Msg-Id`` window drops duplicate publishes, not a second
        handling of a redelivery: see :mod:`._nats_dedup`.)
        """
        return NatsDedupStore(self, window)

    def rate_store(self) -> NatsRateStore:
        """``RateLimit``'s shared turns in NATS: a JetStream KV bucket, one key per
        bucket, written at the revision read."""
        return NatsRateStore(self)

    def lease_store(self) -> NatsLeaseStore:
        """``max_in_flight``'s slots in NATS: a JetStream KV bucket, one key of leases per
        stage, written at the revision read."""
        return NatsLeaseStore(self)

    async def backlog(self, pattern: str, group: str) -> int:
        """Messages of the group's consumer not yet delivered plus delivered, unsettled."""
        from nats.js.errors import NotFoundError

        _, js = self._client()
        name = consumer_name(pattern, group)
        with broker_call(f"cannot read consumer {name}"):
            try:
                info = await js.consumer_info(self.stream, name)
            except NotFoundError:
                return 0
        return (info.num_pending or 0) + (info.num_ack_pending or 0)

    async def groups(self) -> list[GroupInfo]:
        """The groups (the stream's durable consumers, request inboxes aside), with their
        backlog, the pull requests waiting on them and their last delivery."""
        from nats.js.errors import NotFoundError

        _, js = self._client()
        with broker_call(f"cannot list the consumers of stream {self.stream}"):
            try:
                return await list_groups(js, self.stream, self.prefix)
            except NotFoundError:
                return []  # no stream: no group

    async def beat(self, instance: str, record: bytes) -> None:
        """Write process ``instance``'s heartbeat record (``Bus.cluster_statistics``)."""
        await self._heartbeats.beat(instance, record)

    async def beats(self) -> list[bytes]:
        """Every process's latest heartbeat record."""
        return await self._heartbeats.beats()

    async def forget(self, instance: str) -> None:
        """Delete process ``instance``'s heartbeat record."""
        await self._heartbeats.forget(instance)

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group's durable consumer; the stream drops what only it needed
        (interest retention), and every process's next publish reads the groups again."""
        from nats.js.errors import NotFoundError

        _, js = self._client()
        name = consumer_name(pattern, group)
        with broker_call(f"cannot delete consumer {name} of stream {self.stream}"):
            try:
                await js.delete_consumer(self.stream, name)
            except NotFoundError:
                return False
            finally:
                self._groups.forget()
        return True

    # -- dead letters -------------------------------------------------------------

    async def add_dead_letter(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter stream and wait for the ack.

        The entry's fields go in a header (:func:`dead_letter_to_wire` without the
        payload), the payload is the body as the codec encodes it, or raw when it is
        bytes, so a dead letter is no bigger than the message it came from (a
        :class:`RawBody`, a body that did not decode, is marked ``verbatim``: a replay
        sends it as it came).
        """
        nc, js = self._client()
        payload = entry.envelope.payload
        if isinstance(payload, bytes | bytearray):
            body, kind = bytes(payload), "verbatim" if type(payload) is RawBody else "raw"
        else:
            try:
                body, kind = self.codec.encode(payload), "codec"
            except EncodeError:
                body, kind = repr(payload).encode(), "raw"
        bare = dataclasses.replace(entry, envelope=entry.envelope.evolve(payload=None))
        headers = {
            _HEADER_DEAD_LETTER: dead_letter_to_wire(bare, self.codec).decode(),
            _HEADER_BODY: kind,
        }
        if len(body) + _header_size(headers) > nc.max_payload:
            # Kept without its payload rather than lost (or redelivered forever).
            note = f"payload of {len(body)} bytes not kept: over the server's max_payload"
            bare = dataclasses.replace(
                bare, error=f"{entry.error}; {note}" if entry.error else note
            )
            headers = {
                _HEADER_DEAD_LETTER: dead_letter_to_wire(bare, self.codec).decode(),
                _HEADER_BODY: "dropped",
            }
            body = b""
        from nats.js.errors import NoStreamResponseError

        subject = self.dead_letter_subject(entry.envelope.id)
        with broker_call(f"cannot store the dead letter of {entry.envelope.id}"):
            try:
                await js.publish(subject, body, headers=headers)
            except NoStreamResponseError:
                logger.warning("NATS: no stream captures %s; making it again", subject)
                await self._restore()
                await js.publish(subject, body, headers=headers)

    def dead_letter_subject(self, envelope_id: str) -> str:
        """The subject of the dead letters of ``envelope_id``."""
        return f"{self._dead_prefix}.{_id_token(envelope_id)}"

    def dead_letter_horizon(self) -> float:
        """Epoch seconds before which a dead letter has expired."""
        return time.time() - self.settings.dead_letter_ttl

    def dead_letter_from(self, headers: Mapping[str, str] | None, data: bytes) -> DeadLetter | None:
        """The dead letter a message of the dead-letter stream holds (``None``: unreadable)."""
        headers = headers or {}
        try:
            entry = dead_letter_from_wire(headers[_HEADER_DEAD_LETTER].encode(), self.codec)
        except (KeyError, DecodeError):
            logger.warning("skipping an unreadable dead letter in %s", self.dead_letter_stream)
            return None
        kind = headers.get(_HEADER_BODY)
        payload: Any = None
        if kind == "verbatim":
            payload = RawBody(data)
        elif kind == "raw":
            payload = data
        elif kind == "codec":
            try:
                payload = self.codec.decode(data)
            except DecodeError:
                payload = data
        return dataclasses.replace(entry, envelope=entry.envelope.evolve(payload=payload))

    async def dead_letters(self) -> list[DeadLetter]:
        """Every dead letter in the stream, oldest first, without expired ones."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        nc, js = self._client()
        with broker_call(f"cannot read the dead-letter stream {self.dead_letter_stream}"):
            info = await js.stream_info(self.dead_letter_stream)
        if not info.state.messages:
            return []
        last = info.state.last_seq
        reader = f"reader-{nc.new_inbox().rpartition('.')[2]}"
        config = ConsumerConfig(
            name=reader,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=60.0,
            mem_storage=True,
        )
        entries: list[DeadLetter] = []
        with broker_call(f"cannot read the dead-letter stream {self.dead_letter_stream}"):
            await js.add_consumer(self.dead_letter_stream, config)
            try:
                pull = await js.pull_subscribe_bind(durable=reader, stream=self.dead_letter_stream)
                try:
                    remaining = info.state.messages
                    while remaining > 0:
                        try:
                            msgs = await pull.fetch(
                                min(remaining, 256), timeout=self.request_timeout
                            )
                        except NatsTimeout:
                            break
                        for msg in msgs:
                            entry = self.dead_letter_from(msg.headers, msg.data)
                            if entry is not None:
                                entries.append(entry)
                        metadata = msgs[-1].metadata
                        if metadata.sequence.stream >= last or not metadata.num_pending:
                            break
                        remaining = metadata.num_pending
                finally:
                    with anyio.CancelScope(shield=True):
                        await pull.unsubscribe()
            finally:
                with anyio.CancelScope(shield=True):
                    await js.delete_consumer(self.dead_letter_stream, reader)
        horizon = time.time() - self.settings.dead_letter_ttl
        entries = [entry for entry in entries if entry.dead_at > horizon]
        if self.settings.dead_letter_maxlen > 0:
            del entries[: max(0, len(entries) - self.settings.dead_letter_maxlen)]
        return entries

    async def remove_dead_letters(self, ids: Sequence[str]) -> None:
        """Delete the dead letters of these envelope ids (every entry of each id)."""
        await self._shared_dead.take(ids)

    async def take_dead_letters(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids, each by its sequence (the
        claim); return those this call deleted, telling every watcher."""
        return await self._shared_dead.take(ids)

    async def clear_dead_letters(self) -> None:
        """Purge the dead-letter stream (every watcher reads it again)."""
        _, js = self._client()
        with broker_call(f"cannot purge the dead-letter stream {self.dead_letter_stream}"):
            await js.purge_stream(self.dead_letter_stream)
        await self._shared_dead.stale()

    async def restore_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Store ``entries`` again (taken for a replay that failed); every watcher reads
        the dead letters again."""
        for entry in entries:
            await self.add_dead_letter(entry)
        await self._shared_dead.stale()

    def watch_dead_letters(self) -> AbstractAsyncContextManager[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process."""
        return self._shared_dead.watch()


def _is_inbox(group: str) -> bool:
    return group.startswith(INBOX_GROUP_PREFIX)


@functools.cache
def _client_class() -> type[Client]:
    """nats-py's client, reconnecting where nats-py would close for good.

    On an ``-ERR`` from the server, nats-py (up to 2.16 at least) closes the client
    unless the error is a permissions violation (reported, the connection goes on) or
    a stale connection (reconnected): no reconnection ever follows, so one command the
    server refused (a subject longer than its protocol line, say) ended every publish
    and pull of the process for good. The server closes the connection after such an
    error; this client takes it for a lost connection, as nats-py's own comment there
    suggests, and reconnects as after any other. While the first connection is being
    made, nats-py's handling stays (a refused login fails ``connect``).
    """
    from nats.aio.client import Client

    if not all(hasattr(Client, name) for name in ("_process_err", "_process_op_err")):
        return Client  # a nats-py whose internals changed: its own handling

    from nats.errors import Error as NatsError

    class ReconnectingClient(Client):
        async def _process_err(self, err_msg: str) -> None:
            message = err_msg.strip("'")
            lowered = message.lower()
            if (
                self.is_connecting
                or "permissions violation" in lowered
                or "stale connection" in lowered
            ):
                await super()._process_err(err_msg)
                return
            error = NatsError(f"nats: {message}")
            await self._error_cb(error)
            await self._process_op_err(error)

    return ReconnectingClient


def _close_failed_attempt(nc: Client) -> None:
    """Close the socket of a reconnection attempt that failed after connecting.

    nats-py (up to 2.16 at least) leaves it open when the server accepted the
    connection but did not say hello (a proxy or load balancer in front of a server
    that is down), until the garbage collector finds it; every attempt leaks one.
    """
    transport = getattr(nc, "_transport", None)  # nats-py keeps it private
    close = getattr(transport, "close", None)
    if callable(close):
        with contextlib.suppress(Exception):
            close()


def _server_id(nc: Client | None) -> str | None:
    """The id of the server ``nc`` is connected to (a restarted server has a new one)."""
    info = getattr(nc, "_server_info", None)  # nats-py keeps it private
    server = info.get("server_id") if isinstance(info, dict) else None
    return server if isinstance(server, str) else None


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
