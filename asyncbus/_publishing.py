"""Publishing: envelopes built from a publish's arguments, routed, and their receipts.

:class:`Publisher` holds what ``Bus.publish``, ``publish_nowait``,
``publish_threadsafe`` and ``request`` do; the bus keeps only their public
signatures. The common publish (no observer, every matching stage in this process
with room) is admitted inline, without the mode's general path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

from . import _instrument
from ._admission import Priority
from ._checks import check_headers, check_seconds, check_slip, check_wait
from ._envelope import (
    EMPTY_HEADERS,
    HEADER_KEY,
    HEADER_PRIORITY,
    HEADER_WIRE,
    WIRE_FORMATS,
    Envelope,
    Receipt,
    make_envelope,
    make_envelopes,
    make_receipt,
    make_receipts,
    new_id,
)
from ._exceptions import BusClosedError, ConfigurationError, not_started
from ._handling import current_handling, handled_envelope
from ._modes import Mode, ModeHost
from ._offload import offloaded_envelope
from ._options import PLAIN, PublishOptions
from ._replies import Replies
from ._routing import Router, validate_topic
from ._stage import Stage

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._life import Life

__all__ = ["PublishServices", "Publisher", "ThreadsafePublish"]

_now = time.time


class PublishServices(ModeHost, Protocol):
    """What a :class:`Publisher` reads on the hot path (the bus's services)."""

    yield_now: Callable[[], Awaitable[None]]
    instrumentation: _instrument.Instrumentation | None
    idle_waiters: list[Any]


class ThreadsafePublish:
    """One ``publish_threadsafe`` call: its future, settled exactly once, never cancelled.

    It counts as a pending thread-safe publish (``drain`` waits for it) from the call
    until it is settled: by the publish's task when it ran, or, when the bus stopped
    before that task could run, by the portal future's callback.
    """

    __slots__ = ("future", "publisher", "receipt", "settled")

    def __init__(self, publisher: Publisher, future: concurrent.futures.Future[Receipt]) -> None:
        self.publisher = publisher
        self.future = future
        self.settled = False
        #: What its stages admitted so far, while it waits for room in a fan-out.
        self.receipt: Receipt | None = None
        with publisher._threadsafe_lock:
            publisher.threadsafe_pending += 1

    def settle(self, receipt: Receipt | None, error: BaseException | None = None) -> None:
        """End the call with ``receipt`` or ``error`` (only the first settle counts)."""
        publisher = self.publisher
        with publisher._threadsafe_lock:
            if self.settled:
                return
            self.settled = True
            publisher.threadsafe_pending -= 1
        future = self.future
        # (The caller may have cancelled its future: then there is nothing to tell.)
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(receipt)  # type: ignore[arg-type]
        if (
            publisher._services.idle_waiters
            and threading.get_ident() == publisher._life.loop_thread
        ):
            publisher._wake_drainers()

    def cut_off(self, _: concurrent.futures.Future[None]) -> None:
        """The portal's task ended; if it never ran, the bus stopped first."""
        self.settle(None, BusClosedError("the bus stopped before this publish was made"))


class Publisher:
    """Builds, routes and receipts what one bus publishes (one per bus)."""

    __slots__ = (
        "_life",
        "_mode",
        "_observers",
        "_router",
        "_routes",
        "_services",
        "_system",
        "_threadsafe_lock",
        "_wake_drainers",
        "name",
        "replies",
        "threadsafe_pending",
    )

    def __init__(
        self,
        name: str,
        life: Life,
        wake_drainers: Callable[[], None],
        mode: Mode,
        services: PublishServices,
        router: Router[Stage],
        observers: list[Callable[[Envelope], None]],
    ) -> None:
        self.name = name
        self._life = life
        #: Releases the ``drain()`` calls whose wait is over (the bus's).
        self._wake_drainers = wake_drainers
        self._mode = mode
        self._services = services
        self._router = router
        self._routes = router.cache  # topic -> stages, read directly on the hot path
        self._observers = observers
        self._system = mode.system
        #: Where ``request`` waits for its reply; set by the bus once it is built
        #: (the replies send through :meth:`send`).
        self.replies: Replies | None = None
        self._threadsafe_lock = threading.Lock()
        #: ``publish_threadsafe`` calls not settled yet (``drain()`` waits for them).
        self.threadsafe_pending = 0

    @property
    def system(self) -> str:
        """The transport's name for what this bus sends (``"memory"`` in its stages)."""
        return self._system

    def check_open(self) -> None:
        """Raise :class:`BusClosedError` unless the bus accepts a publish now."""
        state = self._life.state
        if state == "running" or (state == "closing" and current_handling() is not None):
            return
        raise _refusal(state)

    def envelope(
        self,
        topic: str,
        payload: Any,
        options: PublishOptions,
        reply_to: str | None = None,
        cause: Envelope | None = None,
    ) -> Envelope:
        """A new envelope to send, with ``options`` checked; one sent while ``cause`` is
        handled continues its conversation (same ``correlation_id``, ``causation_id`` =
        its id)."""
        if type(topic) is not str:
            validate_topic(topic)  # a ConfigurationError, before it is used as a key
        where = f"publish({topic!r})"
        frozen_headers, route, ttl = _options(topic, options, where)
        id = options.id
        for hop in route:  # a hop the broker cannot carry is refused now, not when forwarded
            self._mode.check_topic(hop)
        if id is not None and (not isinstance(id, str) or not id):
            raise ConfigurationError(f"{where}: id must be a non-empty string, got {id!r}")
        envelope_id = id if id is not None else new_id()
        return make_envelope(
            envelope_id,
            topic,
            payload,
            frozen_headers,
            time.time(),
            ttl,
            1,
            route,
            cause.correlation_id if cause is not None else envelope_id,
            cause.id if cause is not None else None,
            reply_to,
            self.name,
        )

    def send(
        self, kind: _instrument.SendKind, envelope: Envelope, timeout: float | None
    ) -> Awaitable[Receipt]:
        """Route ``envelope``, told to the instrumentation (if any) as a send of ``kind``."""
        instrumentation = self._services.instrumentation
        if instrumentation is None:
            return self._mode.send(envelope, timeout, None)
        return _instrument.send(instrumentation, kind, envelope, self._system, self.route, timeout)

    def route(
        self,
        envelope: Envelope,
        timeout: float | None,
        progress: ThreadsafePublish | None = None,
    ) -> Awaitable[Receipt]:
        """Send ``envelope`` to every group of its topic (see :meth:`Mode.send`)."""
        return self._mode.send(envelope, timeout, progress)

    def publish(
        self, topic: str, payload: Any, options: PublishOptions
    ) -> Receipt | Awaitable[Receipt]:
        """``Bus.publish`` after its yield: build the envelope and admit it.

        :returns: the receipt when every stage took it inline, else what to await for it
            (no coroutine of its own: the common publish costs the bus one frame).
        """
        if self._life.state != "running":  # checked after the yield: aclose may have begun
            self.check_open()
        if type(topic) is not str:
            validate_topic(topic)  # a ConfigurationError, before it is used as a key
        timeout = options.timeout
        if timeout is not None:
            timeout = check_wait(timeout, f"publish({topic!r}): timeout")
        cause = handled_envelope()  # published by a handler: continue its conversation
        if options is not PLAIN or cause is not None:
            envelope = self.envelope(topic, payload, options, cause=cause)
        else:
            envelope_id = new_id()
            envelope = make_envelope(
                envelope_id,
                topic,
                payload,
                EMPTY_HEADERS,
                _now(),
                None,
                1,
                (),
                envelope_id,
                None,
                None,
                self.name,
            )
        if self._services.instrumentation is not None:
            return self.send("publish", envelope, timeout)
        if not self._observers and self._mode.admits_inline:
            # The common case, without the general path's calls: every stage has room.
            stages = self._routes.get(topic) or self._router.route(topic)
            # (Stage.has_room, inlined: this runs once per publish.)
            if len(stages) == 1:
                stage = stages[0]
                if stage.queued < stage.capacity and not stage.room_waiters:
                    stage.admit(envelope)
                    return make_receipt(envelope.id, stage.names)
            elif stages and all(
                stage.queued < stage.capacity and not stage.room_waiters for stage in stages
            ):
                for stage in stages:
                    stage.admit(envelope)
                return make_receipt(envelope.id, self._router.names(topic))
        return self._mode.send(envelope, timeout, None)

    def send_many(
        self, kind: _instrument.SendKind, envelopes: list[Envelope], timeout: float | None
    ) -> Awaitable[list[Receipt]]:
        """Route ``envelopes`` (one topic), told to the instrumentation (if any) one by one."""
        instrumentation = self._services.instrumentation
        if instrumentation is None:
            return self._mode.send_many(envelopes, timeout)
        return _instrument.send_many(
            instrumentation, kind, envelopes, self._system, self._mode.send_many, timeout
        )

    def publish_many(
        self, topic: str, payloads: Iterable[Any], options: PublishOptions
    ) -> list[Receipt] | Awaitable[list[Receipt]]:
        """``Bus.publish_many`` after its yield: one envelope per payload, admitted in order.

        :returns: the receipts when every stage took every envelope inline, else what
            to await for them.
        """
        timeout = options.timeout
        envelopes = self.build_many(topic, payloads, options)
        if timeout is not None:
            timeout = check_wait(timeout, f"publish_many({topic!r}): timeout")
        if not envelopes:
            return self._mode.send_none()
        if self._services.instrumentation is not None:
            return self.send_many("publish", envelopes, timeout)
        if not self._observers and self._mode.admits_inline:
            # The common case: every stage has room for all of them, nobody waits.
            stages = self._routes.get(topic) or self._router.route(topic)
            count = len(envelopes)
            if stages and all(stage.has_room(count) for stage in stages):
                for stage in stages:
                    stage.admit_many(envelopes)
                names = stages[0].names if len(stages) == 1 else self._router.names(topic)
                return make_receipts(envelopes, names)
        return self._mode.send_many(envelopes, timeout)

    def build_many(
        self, topic: str, payloads: Iterable[Any], options: PublishOptions
    ) -> list[Envelope]:
        """``publish_many``'s envelopes, built and checked, not sent (the bus is open,
        on its event loop's thread, and the broker can carry the topic)."""
        life = self._life
        if life.state != "running":  # checked after the yield: aclose may have begun
            self.check_open()
        if threading.get_ident() != life.loop_thread:
            raise RuntimeError(
                f"publish_many({topic!r}) was called from a thread other than the event "
                "loop's: use bus.publish_threadsafe(...) from other threads"
            )
        validate_topic(topic)
        self._mode.check_topic(topic)
        where = f"publish_many({topic!r})"
        if options.timeout is not None:
            check_wait(options.timeout, f"{where}: timeout")
        frozen_headers, route, ttl = _options(topic, options, where)
        for hop in route:  # a hop the broker cannot carry is refused now, not when forwarded
            self._mode.check_topic(hop)
        if isinstance(payloads, _ONE_PAYLOAD) or not isinstance(payloads, Iterable):
            raise ConfigurationError(
                f"{where}: payloads must be an iterable of payloads, got {type(payloads).__name__}"
            )
        cause = handled_envelope()  # published by a handler: continue its conversation
        return make_envelopes(
            topic,
            payloads,
            frozen_headers,
            _now(),
            ttl,
            route,
            None if cause is None else (cause.correlation_id, cause.id),
            self.name,
        )

    def build_one(self, topic: str, payload: Any, options: PublishOptions) -> Envelope:
        """``publish``'s envelope, built and checked, not sent (see `build_many`)."""
        if self._life.state != "running":
            self.check_open()
        if type(topic) is not str:
            validate_topic(topic)
        if options.timeout is not None:
            check_wait(options.timeout, f"publish({topic!r}): timeout")
        envelope = self.envelope(topic, payload, options, cause=handled_envelope())
        self._mode.check_topic(topic)
        return envelope

    def publish_nowait(self, topic: str, payload: Any, options: PublishOptions) -> Receipt:
        """``Bus.publish_nowait``: admit everywhere now, or nowhere."""
        self.check_open()
        if threading.get_ident() != self._life.loop_thread:
            # The stages' queues and wake-ups belong to the loop: touched from another
            # thread, a consumer may never wake (trio) or the loop never notice.
            raise RuntimeError(
                f"publish_nowait({topic!r}) was called from a thread other than the event "
                "loop's: use bus.publish_threadsafe(...) from other threads"
            )
        if options.timeout is not None:
            check_wait(options.timeout, f"publish_nowait({topic!r}): timeout")
        self._mode.check_nowait()
        envelope = self.envelope(topic, payload, options, cause=handled_envelope())
        instrumentation = self._services.instrumentation
        if instrumentation is not None:
            return _instrument.send_now(
                instrumentation, "publish", envelope, self._system, self._mode.send_now
            )
        return self._mode.send_now(envelope)

    def publish_threadsafe(
        self, topic: str, payload: Any, options: PublishOptions
    ) -> concurrent.futures.Future[Receipt]:
        """``Bus.publish_threadsafe``: run the publish on the loop, its outcome in a future."""
        life = self._life
        handling = current_handling()
        inside = handling is not None
        # What the call is made in, captured here (the publish itself runs on the loop):
        # the envelope it handles, if made by a handler (in a worker thread, the one
        # its offloaded handler was given), and the context observers read.
        cause = offloaded_envelope() if threading.get_ident() != life.loop_thread else None
        if cause is None and handling is not None:
            cause = handling.envelope
        context = contextvars.copy_context() if self._services.instrumentation is not None else None
        future: concurrent.futures.Future[Receipt] = concurrent.futures.Future()
        job = ThreadsafePublish(self, future)
        arguments = (inside, cause, context, topic, payload, options)
        try:
            task_group = life.task_group
            if threading.get_ident() == life.loop_thread and task_group is not None:
                task_group.start_soon(self._publish_into, job, *arguments)
                return future
            portal = life.portal
            if portal is None:
                raise _refusal(life.state)
            portal.start_task_soon(self._publish_into, job, *arguments).add_done_callback(
                job.cut_off
            )
        except BusClosedError as error:
            job.settle(None, error)
        except RuntimeError as error:  # anyio: the portal or task group stopped meanwhile
            job.settle(None, BusClosedError(f"the bus stopped: {error}"))
        return future

    async def _publish_into(self, job: ThreadsafePublish, *arguments: Any) -> None:
        try:
            receipt = await self._publish_for_thread(job, *arguments)
        except Exception as error:
            job.settle(None, error)
        except BaseException:
            # Deliberate: cancelled by the stop. The future is told so (with what was
            # admitted before it waited), then the cancellation goes on.
            job.settle(
                None,
                BusClosedError(
                    "the bus stopped before this publish was admitted everywhere",
                    receipt=job.receipt,
                ),
            )
            raise
        else:
            job.settle(receipt)

    async def _publish_for_thread(
        self,
        job: ThreadsafePublish,
        inside: bool,
        cause: Envelope | None,
        context: contextvars.Context | None,
        topic: str,
        payload: Any,
        options: PublishOptions,
    ) -> Receipt:
        state = self._life.state
        if not (state == "running" or (state == "closing" and inside)):
            raise _refusal(state)
        timeout = options.timeout
        if timeout is not None:
            timeout = check_wait(timeout, f"publish_threadsafe({topic!r}): timeout")
        envelope = self.envelope(topic, payload, options, cause=cause)
        route = functools.partial(self.route, progress=job)
        instrumentation = self._services.instrumentation
        if context is None or instrumentation is None:
            return await route(envelope, timeout)
        # Observers see the send in the caller's context (a handler's, in its thread).
        return await _instrument.send(
            instrumentation,
            "publish",
            envelope,
            self._system,
            route,
            timeout,
            context,
        )

    async def request(
        self,
        topic: str,
        payload: Any,
        slip: Sequence[str],
        timeout: float | None,
        headers: Mapping[str, str] | None,
        ttl: float | None,
        hold: Callable[[Envelope], Awaitable[Receipt]] | None = None,
    ) -> Any:
        """``Bus.request``: publish with a reply address (or ``hold`` it until it is
        due), then wait for the reply."""
        replies = self.replies
        assert replies is not None, "the bus sets its replies before it starts"
        await self._services.yield_now()  # first, like publish: aclose may begin meanwhile
        self.check_open()
        seconds = check_wait(timeout, f"request({topic!r}): timeout")
        envelope_id = new_id()
        reply_to = await replies.address(envelope_id)
        options = PublishOptions(headers=headers, ttl=ttl, slip=slip, id=envelope_id)
        envelope = self.envelope(
            topic, payload, options, reply_to=reply_to, cause=handled_envelope()
        )
        self._mode.check_topic(topic)
        return await replies.wait_for(envelope, seconds, hold)


def _options(
    topic: str, options: PublishOptions, where: str
) -> tuple[Mapping[str, str], tuple[str, ...], float | None]:
    """The checked headers (key and priority included), slip and ttl of a publish."""
    headers, key, priority = options.headers, options.key, options.priority
    if headers or key is not None or priority is not None:
        fields = dict(check_headers(headers or {}, where))
        if key is not None:
            fields[HEADER_KEY] = str(key)
        if priority is not None:
            fields[HEADER_PRIORITY] = _priority_text(topic, priority)
        wire = fields.get(HEADER_WIRE)
        if wire is not None and wire not in WIRE_FORMATS:
            raise ConfigurationError(
                f"{where}: header {HEADER_WIRE!r} is {wire!r}; it takes one of "
                f"{', '.join(map(repr, WIRE_FORMATS))}"
            )
        frozen_headers: Mapping[str, str] = MappingProxyType(fields)
    else:
        frozen_headers = EMPTY_HEADERS
    route = check_slip(options.slip, where)
    for hop in route:
        validate_topic(hop)
    ttl = options.ttl
    if ttl is not None:
        ttl = check_seconds(ttl, f"{where}: ttl")
    return frozen_headers, route, ttl


#: What ``publish_many`` refuses as its ``payloads``: iterable, but surely one payload.
_ONE_PAYLOAD = (str, bytes, bytearray, Mapping)


def _priority_text(topic: str, priority: Priority | int) -> str:
    """The ``asyncbus-priority`` header value of ``priority``, validated."""
    if isinstance(priority, bool) or not isinstance(priority, int) or priority not in _PRIORITIES:
        raise ConfigurationError(
            f"publish({topic!r}): priority must be a Priority (0 to {max(_PRIORITIES)}), "
            f"got {priority!r}"
        )
    return str(int(priority))


_PRIORITIES = frozenset(int(level) for level in Priority)


def _refusal(state: str) -> BusClosedError:
    """Why a publish is refused while the bus is ``state``."""
    if state == "new":
        return not_started("publish")
    return BusClosedError(f"the bus is {state}: it accepts no new publishes")
