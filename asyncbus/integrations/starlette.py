"""Run a bus inside a Starlette or FastAPI app, and administer it over HTTP.

Install with ``pip install 'asyncbus[starlette]'``. ``import asyncbus`` never imports
this module; importing it imports Starlette.

.. code-block:: python

    from typing import Annotated

    from fastapi import Depends, FastAPI

    from asyncbus import Bus
    from asyncbus.integrations.starlette import admin_app, get_bus, lifespan

    bus = Bus()
    app = FastAPI(lifespan=lifespan(bus))          # `async with bus:` for the app's life
    app.mount("/admin", admin_app(bus, token=ADMIN_TOKEN))

    @app.post("/orders", status_code=202)
    async def create_order(order: Order, bus: Annotated[Bus, Depends(get_bus)]) -> None:
        await bus.publish("orders.created", order)

Within a lifespan of your own, enter the bus's next to your other resources::

    @contextlib.asynccontextmanager
    async def app_lifespan(app):
        async with database(), lifespan(bus)(app):
            yield

The admin app is for operators: mount it behind your app's own authentication (or at
least give it a ``token``), and serve it on the event loop that runs the bus (mounting
it in the app whose lifespan runs the bus does exactly that). Its ``/healthz`` and
``/readyz`` are the probes for an orchestrator (they answer without the token), and
``admin_app(bus, metrics=True)`` also serves Prometheus metrics at ``/metrics``. It
also describes the bus: its AsyncAPI document at ``/asyncapi.json``, shown as a page at
``/asyncapi`` (``asyncapi=False`` leaves both out).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio

try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.requests import HTTPConnection, Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "asyncbus.integrations.starlette needs the 'starlette' extra: "
        "pip install 'asyncbus[starlette]'"
    ) from error

from .._bus import DEADLETTER_TOPIC, Bus
from .._checks import check_wait
from .._cluster import ProcessStatistics
from .._dead_letters import DeadLetter, DeadLetterReason
from .._exceptions import BusClosedError, ConfigurationError, TransportError
from .._groups import GroupInfo, group_document
from .._observe import bus_state, stages_subscribed
from ..asyncapi import document
from ..transports.base import BacklogReader
from ._admin_pages import ASYNCAPI_PAGE, AUTHORISED, DASHBOARD, BearerAuth
from ._admin_requests import (
    Problem,
    ids_of,
    json_object,
    on_http_exception,
    on_problem,
    on_server_error,
    query_int,
)
from ._json import json_safe

__all__ = ["admin_app", "get_bus", "lifespan"]

logger = logging.getLogger("asyncbus.integrations.starlette")

_STATE_ATTRIBUTE = "asyncbus"
_REASONS = tuple(reason.value for reason in DeadLetterReason)
_DEFAULT_LIMIT = 100
_MAX_LIMIT = 1000
#: Seconds the transport has to answer a liveness probe.
_HEALTH_DEADLINE = 1.0
#: The reasons /healthz gives for a broker that does not answer (the detail is logged,
#: and shown to a caller that presents the token).
_BROKER_SILENT = "broker did not answer"
_BROKER_FAILED = "broker failed"
#: What ``admin_app(asyncapi={...})`` may pass on to :func:`asyncbus.asyncapi.document`.
_DOCUMENT_OPTIONS = frozenset({"title", "version", "description", "publications"})


# -- lifespan and dependency ------------------------------------------------------


def lifespan(
    bus: Bus, *, timeout: float | None = 30.0
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """Return a lifespan that runs ``bus`` for the life of a Starlette or FastAPI app.

    Pass it as ``Starlette(lifespan=lifespan(bus))`` / ``FastAPI(lifespan=...)``, or
    enter ``lifespan(bus)(app)`` inside a lifespan of your own. Startup enters
    ``async with bus:`` and stores the bus on ``app.state`` for :func:`get_bus`;
    shutdown drains it (a warning is logged when ``timeout`` seconds were not enough and
    envelopes were abandoned). If the app fails, the bus is cancelled at once instead.

    :param timeout: seconds to drain at shutdown (``None``: wait as long as it takes).
    :raises ConfigurationError: for a timeout that is not ``None`` or a finite number
        ``>= 0`` (here, not at shutdown).
    """
    check_wait(timeout, "lifespan(timeout)")

    @contextlib.asynccontextmanager
    async def bus_lifespan(app: Starlette) -> AsyncIterator[None]:
        async with bus:
            setattr(app.state, _STATE_ATTRIBUTE, bus)
            try:
                yield
            finally:
                with contextlib.suppress(AttributeError):
                    delattr(app.state, _STATE_ATTRIBUTE)
            report = await bus.aclose(timeout)
            if not report.drained:
                logger.warning(
                    "bus %r did not drain within %ss at shutdown; %d envelope(s) abandoned",
                    bus.name,
                    timeout,
                    len(report.abandoned),
                )

    return bus_lifespan


def get_bus(connection: HTTPConnection) -> Bus:
    """Return the bus that :func:`lifespan` runs for the app serving ``connection``.

    Use it as a FastAPI dependency (``Annotated[Bus, Depends(get_bus)]``) or call it with
    the request in a plain Starlette endpoint; websockets work the same.

    :raises RuntimeError: when the app's lifespan does not run a bus (or has ended).
    """
    bus = getattr(connection.app.state, _STATE_ATTRIBUTE, None)
    if not isinstance(bus, Bus):
        raise RuntimeError(
            "no running bus on this app: create it with "
            "lifespan=asyncbus.integrations.starlette.lifespan(bus), or enter "
            "lifespan(bus)(app) in your own lifespan"
        )
    return bus


# -- JSON -------------------------------------------------------------------------


def _dead_letter_json(entry: DeadLetter) -> dict[str, Any]:
    envelope = entry.envelope
    return {
        "id": envelope.id,
        "topic": envelope.topic,
        "reason": str(entry.reason),
        "error": entry.error,
        "traceback": entry.traceback,
        "stage": entry.stage,
        "attempts": entry.attempts,
        "dead_at": json_safe(entry.dead_at),
        "envelope": {
            "id": envelope.id,
            "topic": envelope.topic,
            "payload": json_safe(envelope.payload),
            "headers": {str(k): str(v) for k, v in envelope.headers.items()},
            "timestamp": json_safe(envelope.timestamp),
            "ttl": json_safe(envelope.ttl),
            "attempt": envelope.attempt,
            "slip": list(envelope.slip),
            "correlation_id": envelope.correlation_id,
            "causation_id": envelope.causation_id,
            "reply_to": envelope.reply_to,
            "sender": envelope.sender,
        },
    }


# -- the admin API ----------------------------------------------------------------


class _AdminApi:
    """The endpoints of :func:`admin_app`, bound to one bus."""

    def __init__(self, bus: Bus, asyncapi: Mapping[str, Any]) -> None:
        self.bus = bus
        # The broker problem last logged by a health probe (None: none, or answering).
        self._logged: str | None = None
        self.asyncapi = asyncapi

    async def _unknown(self, ids: list[str]) -> list[str]:
        """The ids the dead-letter queue does not list. Over a broker, one it does not
        list yet (stored by another process a moment ago) is looked for again after
        reading the broker."""
        queue = self.bus.dead_letters
        unknown = [id for id in ids if queue.get(id) is None]
        if unknown:
            try:
                await queue.refresh()
            except TransportError as error:
                logger.warning("could not read the broker's dead letters: %s", error)
                return unknown
            unknown = [id for id in ids if queue.get(id) is None]
        return unknown

    async def _check_known(self, ids: list[str]) -> None:
        unknown = await self._unknown(ids)
        if unknown:
            raise _unknown_ids(unknown)

    async def page(self, request: Request) -> Response:
        return HTMLResponse(DASHBOARD[0], headers=DASHBOARD[1])

    async def asyncapi_page(self, request: Request) -> Response:
        return HTMLResponse(ASYNCAPI_PAGE[0], headers=ASYNCAPI_PAGE[1])

    async def asyncapi_document(self, request: Request) -> Response:
        spec = document(self.bus, **self.asyncapi)
        return JSONResponse(spec, headers={"Cache-Control": "no-store"})

    async def stats(self, request: Request) -> Response:
        return JSONResponse(json_safe(dataclasses.asdict(self.bus.statistics())))

    async def dead_letters(self, request: Request) -> Response:
        reason = request.query_params.get("reason") or None
        if reason is not None and reason not in _REASONS:
            raise Problem(400, f"unknown reason {reason!r}; expected one of {', '.join(_REASONS)}")
        order = request.query_params.get("order", "oldest")
        if order not in ("oldest", "newest"):
            raise Problem(400, "query parameter 'order' must be 'oldest' or 'newest'")
        limit = query_int(request, "limit", _DEFAULT_LIMIT, 1, _MAX_LIMIT)
        offset = query_int(request, "offset", 0, 0, 2**62)
        queue = self.bus.dead_letters
        everything = queue.list()
        matching = queue.list(reason=reason, topic=request.query_params.get("topic") or None)
        if order == "newest":
            matching.reverse()
        by_reason = dict.fromkeys(_REASONS, 0)
        for entry in everything:
            by_reason[str(entry.reason)] = by_reason.get(str(entry.reason), 0) + 1
        return JSONResponse(
            {
                "total": len(matching),
                "offset": offset,
                "limit": limit,
                "order": order,
                "queue_length": len(everything),
                "by_reason": by_reason,
                "items": [_dead_letter_json(e) for e in matching[offset : offset + limit]],
            }
        )

    async def dead_letter(self, request: Request) -> Response:
        id = request.path_params["id"]
        await self._unknown([id])
        entries = [entry for entry in self.bus.dead_letters.list() if entry.envelope.id == id]
        if not entries:
            raise Problem(404, f"not in the dead-letter queue: {id}", unknown_ids=[id])
        return JSONResponse({"id": id, "items": [_dead_letter_json(e) for e in entries]})

    async def replay(self, request: Request) -> Response:
        ids = ids_of(await json_object(request, frozenset({"ids"})))
        if not self.bus.running:
            raise Problem(409, "the bus is not running; replay needs a running bus")
        # Replay takes entries out of the queue before re-sending them: finish even if
        # the client goes away, so none is lost half-way. What is not in the queue
        # (over a broker: not in the broker's store, whichever process lists it) is
        # refused as a whole.
        with anyio.CancelScope(shield=True):
            try:
                receipts = await self.bus.dead_letters.replay(*ids)
            except KeyError as error:
                unknown = getattr(error, "ids", None)
                raise _unknown_ids(unknown if isinstance(unknown, list) else ids) from None
        return JSONResponse(
            {
                "replayed": ids,
                "receipts": [
                    {
                        "id": receipt.id,
                        "accepted": list(receipt.accepted),
                        "rejected": list(receipt.rejected),
                        "dropped": list(receipt.dropped),
                    }
                    for receipt in receipts
                ],
            }
        )

    async def cluster(self, request: Request) -> Response:
        view = self.bus.cluster_statistics()
        return JSONResponse(
            json_safe(
                {
                    "served_by": _process_json(view.processes[0]),
                    "processes": [_process_json(process) for process in view.processes],
                    "totals": dataclasses.asdict(view.totals),
                }
            ),
            headers={"Cache-Control": "no-store"},
        )

    async def groups(self, request: Request) -> Response:
        try:
            groups = await self.bus.groups()
        except BusClosedError as error:
            raise Problem(409, str(error)) from None
        except TransportError as error:
            raise Problem(502, f"the broker did not list its groups: {error}") from None
        return JSONResponse(
            {"groups": [_group_json(info) for info in groups]},
            headers={"Cache-Control": "no-store"},
        )

    async def delete_group(self, request: Request) -> Response:
        body = await json_object(request, frozenset({"pattern", "group", "force"}))
        pattern, group, force = body.get("pattern"), body.get("group"), body.get("force", False)
        if not isinstance(pattern, str) or not isinstance(group, str) or not pattern or not group:
            raise Problem(422, '"pattern" and "group" must be non-empty strings')
        if not isinstance(force, bool):
            raise Problem(422, '"force" must be true or false')
        try:
            with anyio.CancelScope(shield=True):
                deleted = await self.bus.delete_group(pattern, group, force=force)
        except (BusClosedError, ConfigurationError) as error:
            raise Problem(409, str(error)) from None
        except TransportError as error:
            raise Problem(502, f"the broker did not delete the group: {error}") from None
        return JSONResponse({"deleted": deleted, "name": f"{pattern}@{group}"})

    async def healthz(self, request: Request) -> Response:
        state = bus_state(self.bus)
        if state not in ("running", "closing"):
            return _status(503, "down", f"the bus is {state}")
        problem = await _transport_problem(self.bus)
        self._log_problem(problem)
        if problem is not None:
            # The broker's own words name its user, address and stages: the log and
            # the token holder get them, an anonymous probe only the reason.
            reason, detail = problem
            if request.scope.get("state", {}).get(AUTHORISED):
                return _status(503, "down", reason, detail=detail)
            return _status(503, "down", reason)
        # Draining is alive: a liveness probe failing now would kill it mid-drain.
        return _status(200, "ok" if state == "running" else "closing")

    def _log_problem(self, problem: tuple[str, str] | None) -> None:
        """Log the broker's problem when it changes (probes come every few seconds)."""
        detail = None if problem is None else problem[1]
        if detail == self._logged:
            return
        if detail is not None:
            logger.warning("health probe: %s", detail)
        else:
            logger.warning("health probe: the broker answers again")
        self._logged = detail

    async def readyz(self, request: Request) -> Response:
        state = bus_state(self.bus)
        if state == "closing":
            return _status(503, "not ready", "the bus is closing: draining, publishes refused")
        if state != "running":
            return _status(503, "not ready", f"the bus is {state}")
        if not stages_subscribed(self.bus):
            return _status(503, "not ready", "broker subscriptions are being set up")
        return _status(200, "ready")

    async def purge(self, request: Request) -> Response:
        body = await json_object(request, frozenset({"ids", "all"}))
        if "all" in body:
            if body["all"] is not True or "ids" in body:
                raise Problem(422, 'send either {"all": true} or {"ids": [...]}, not both')
            return JSONResponse({"purged": self.bus.dead_letters.purge()})
        ids = ids_of(body)
        await self._check_known(ids)
        return JSONResponse({"purged": self.bus.dead_letters.purge(*ids)})


def _process_json(process: ProcessStatistics) -> dict[str, Any]:
    statistics = process.statistics
    return {
        "name": process.name,
        "host": process.host,
        "pid": process.pid,
        "instance": process.instance,
        "bus": process.bus,
        "started": process.started,
        "seen": process.seen,
        "stale": process.stale,
        "this_process": process.this_process,
        "published": statistics.published,
        "acked": statistics.acked,
        "dead_lettered": statistics.dead_lettered,
        "in_flight": statistics.in_flight,
        "depth": statistics.depth,
    }


def _group_json(info: GroupInfo) -> dict[str, Any]:
    return {**group_document(info), "local": info.local}


def _unknown_ids(ids: list[str]) -> Problem:
    return Problem(
        404,
        f"not in the dead-letter queue: {', '.join(ids)}; nothing was changed",
        unknown_ids=ids,
    )


def _status(
    code: int, status: str, reason: str | None = None, *, detail: str | None = None
) -> JSONResponse:
    body = {"status": status}
    if reason is not None:
        body["reason"] = reason
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=code, headers={"Cache-Control": "no-store"})


async def _transport_problem(bus: Bus) -> tuple[str, str] | None:
    """Why the bus's broker is not answering: ``(reason, detail)``, or ``None`` (always
    ``None`` in memory). The reason is one of a few fixed phrases; the detail is the
    broker's error, which may name its user, address and stages.

    Asks the backlog of one stage, the cheapest question a broker answers (a transport
    that cannot count is not asked).
    """
    transport = bus.transport
    if transport is None or transport.direct or not isinstance(transport, BacklogReader):
        return None
    stage = next((each for each in bus.statistics().stages if each.topic != DEADLETTER_TOPIC), None)
    if stage is None:
        return None  # nothing subscribed: nothing to ask
    try:
        with anyio.fail_after(_HEALTH_DEADLINE):
            await transport.backlog(stage.topic, stage.group)
    except TimeoutError:
        return _BROKER_SILENT, f"{transport.name} did not answer within {_HEALTH_DEADLINE:g}s"
    except Exception as error:
        return _BROKER_FAILED, f"{transport.name} failed: {type(error).__name__}: {error}"
    return None


def admin_app(
    bus: Bus,
    *,
    token: str | None = None,
    metrics: bool = False,
    asyncapi: bool | Mapping[str, Any] = True,
) -> Starlette:
    """Return an ASGI app that shows and administers ``bus``; mount it anywhere.

    Routes (JSON unless said otherwise; errors are ``{"error": message}`` with a 4xx
    status, and a request that fails changes nothing in the bus):

    * ``GET /`` -- a self-contained live HTML dashboard (stages, depths, rates,
      latencies, dead letters with replay), polling the routes below every second;
    * ``GET /stats`` -- :meth:`Bus.statistics` as ``dataclasses.asdict``;
    * ``GET /dead-letters?reason=&topic=&limit=100&offset=0&order=oldest`` -- one page
      of the dead-letter queue plus ``total`` (matching), ``queue_length`` and
      ``by_reason`` (over the whole queue); over a broker, every process's dead letters
      (``bus.dead_letters`` is the broker's list), and replay and purge act on any of
      them, a replay at most once however many processes or clicks ask;
    * ``GET /dead-letters/{id}`` -- the entries of one envelope id;
    * ``POST /dead-letters/replay`` with ``{"ids": [...]}`` -- 404 naming unknown ids,
      409 when the bus is not running;
    * ``POST /dead-letters/purge`` with ``{"ids": [...]}`` or ``{"all": true}``;
    * ``GET /cluster`` -- :meth:`Bus.cluster_statistics`: ``served_by`` (the replica
      that answered: host, pid, instance), ``processes`` (each with its ledger totals,
      ``stale`` when its heartbeats stopped) and ``totals`` (their sums);
    * ``GET /groups`` -- ``{"groups": [...]}``, :meth:`Bus.groups` (every process's
      groups over a broker: pattern, group, name, backlog, consumers, last_active,
      local); 409 when the bus is not running over a broker, 502 when the broker fails;
    * ``POST /groups/delete`` with ``{"pattern": ..., "group": ..., "force": false}`` --
      :meth:`Bus.delete_group`: ``{"deleted": true|false, "name": ...}``; 409 when it is
      refused (a group this process subscribes to, or consumers read it without
      ``force``);
    * ``GET /asyncapi.json`` -- the bus's AsyncAPI 3.0 document
      (:func:`asyncbus.asyncapi.document`), made anew for each request;
    * ``GET /asyncapi`` -- a self-contained HTML page showing that document (its
      operations, channels, messages and schemas; it loads nothing from elsewhere);
    * ``GET /metrics`` (with ``metrics=True``) -- Prometheus metrics in the text format
      (:class:`asyncbus.integrations.prometheus.BusCollector`; extra ``prometheus``);
    * ``GET /healthz`` -- liveness: 200 ``{"status": "ok"}`` while the bus runs (also
      ``"closing"`` while it drains) and its broker answered within 1 s, else 503
      ``{"status": "down", "reason": ...}``: ``"the bus is <state>"``, ``"broker did
      not answer"`` or ``"broker failed"``. The broker's error (which may name its
      user, address and stages) is logged when it changes, and added as ``"detail"``
      only for a caller that presents the token;
    * ``GET /readyz`` -- readiness: 200 ``{"status": "ready"}`` while the bus runs and
      every broker subscription exists; 503 with the reason before that and from the
      moment ``aclose`` begins, so a load balancer stops sending work before the drain.

    The two probes answer without the token (probes seldom can send one, and they
    reveal nothing but the status and a fixed reason); everything else needs it when
    one is given.

    POST bodies must be ``Content-Type: application/json`` (so a cross-site form
    cannot post one). Serve it on the event loop that runs the bus, behind your app's
    own authentication.

    :param token: when given, every route but the probes needs ``Authorization: Bearer
        <token>`` (else 401); the page also accepts ``?token=<token>`` and passes it on.
    :param metrics: serve ``GET /metrics`` (needs ``prometheus-client``).
    :param asyncapi: serve ``/asyncapi.json`` and ``/asyncapi`` (``False``: neither);
        a mapping gives :func:`~asyncbus.asyncapi.document` its ``title``,
        ``version``, ``description`` and ``publications``.
    :raises ConfigurationError: when ``token`` is empty, or ``asyncapi`` holds
        something :func:`~asyncbus.asyncapi.document` refuses.
    :raises ImportError: for ``metrics=True`` without ``prometheus-client``.
    """
    if token is not None and (not isinstance(token, str) or not token):
        raise ConfigurationError("admin_app: token must be a non-empty string or None")
    options = _document_options(bus, asyncapi)
    api = _AdminApi(bus, options or {})
    routes = [
        Route("/", api.page, methods=["GET"]),
        Route("/stats", api.stats, methods=["GET"]),
        Route("/dead-letters", api.dead_letters, methods=["GET"]),
        Route("/dead-letters/replay", api.replay, methods=["POST"]),
        Route("/dead-letters/purge", api.purge, methods=["POST"]),
        Route("/dead-letters/{id}", api.dead_letter, methods=["GET"]),
        Route("/cluster", api.cluster, methods=["GET"]),
        Route("/groups", api.groups, methods=["GET"]),
        Route("/groups/delete", api.delete_group, methods=["POST"]),
        Route("/healthz", api.healthz, methods=["GET"]),
        Route("/readyz", api.readyz, methods=["GET"]),
    ]
    if metrics:
        routes.append(Route("/metrics", _metrics_endpoint(bus), methods=["GET"]))
    if options is not None:
        routes.append(Route("/asyncapi", api.asyncapi_page, methods=["GET"]))
        routes.append(Route("/asyncapi.json", api.asyncapi_document, methods=["GET"]))
    middleware = [Middleware(BearerAuth, token=token)] if token is not None else []
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            Problem: on_problem,
            HTTPException: on_http_exception,
            Exception: on_server_error,
        },
    )


def _document_options(bus: Bus, asyncapi: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``document``'s keyword arguments for ``admin_app(asyncapi=...)``; ``None``: off.

    A mapping is checked here, by making the document once, so a mistake in it
    fails when the app is made rather than on the first request.
    """
    if isinstance(asyncapi, bool):
        return {} if asyncapi else None
    if not isinstance(asyncapi, Mapping):
        raise ConfigurationError(
            f"admin_app: asyncapi must be a bool or a mapping of document() options, "
            f"got {asyncapi!r}"
        )
    unknown = sorted(set(asyncapi) - _DOCUMENT_OPTIONS)
    if unknown:
        raise ConfigurationError(
            f"admin_app: asyncapi: unknown option(s) {', '.join(map(repr, unknown))}; "
            f"expected some of {', '.join(sorted(_DOCUMENT_OPTIONS))}"
        )
    options = dict(asyncapi)
    document(bus, **options)
    return options


def _metrics_endpoint(bus: Bus) -> Callable[[Request], Awaitable[Response]]:
    from .prometheus import exposition  # its ImportError names the extra

    render = exposition(bus)

    async def metrics(request: Request) -> Response:
        body, media_type = render()
        return Response(body, media_type=media_type, headers={"Cache-Control": "no-store"})

    return metrics
