"""The admin API's requests and errors: a client error answered as JSON, and query
parameters and bodies read with limits."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = [
    "Problem",
    "ids_of",
    "json_object",
    "on_http_exception",
    "on_problem",
    "on_server_error",
    "query_int",
]

#: The largest request body read, in bytes.
MAX_BODY = 1 << 20
#: The most envelope ids one request may name.
MAX_IDS = 10_000


class Problem(Exception):
    """A client error, answered as ``{"error": message, **extra}`` with ``status``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.extra = extra


def error_response(status: int, message: str, **extra: Any) -> JSONResponse:
    """``{"error": message, **extra}`` with ``status``."""
    return JSONResponse({"error": message, **extra}, status_code=status)


async def on_problem(request: Request, exc: Exception) -> Response:
    """A :class:`Problem` raised by a route, answered as its JSON error."""
    assert isinstance(exc, Problem)
    return error_response(exc.status, exc.message, **exc.extra)


async def on_http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own HTTP errors (404, 405...), answered as JSON too."""
    assert isinstance(exc, HTTPException)
    return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def on_server_error(request: Request, exc: Exception) -> Response:
    """Anything else a route raised: a 500 naming the exception's type only."""
    return error_response(500, f"internal error: {type(exc).__name__}")


def query_int(request: Request, name: str, default: int, low: int, high: int) -> int:
    """Query parameter ``name`` as an int from ``low`` to ``high`` (400 otherwise)."""
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise Problem(400, f"query parameter {name!r} must be an integer in [{low}, {high}]")
    return value


async def json_object(request: Request, fields: frozenset[str]) -> dict[str, Any]:
    """The body as a JSON object of ``fields`` at most, read up to :data:`MAX_BODY` bytes."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise Problem(415, "the request body must be JSON (Content-Type: application/json)")
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) > MAX_BODY:
                raise Problem(413, f"the request body is over {MAX_BODY} bytes")
    try:
        value = json.loads(body)
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise Problem(400, f"malformed JSON: {error}") from None
    if not isinstance(value, dict):
        raise Problem(422, f"the body must be a JSON object, got {type(value).__name__}")
    unexpected = sorted(set(value) - fields)
    if unexpected:
        raise Problem(
            422,
            f"unexpected field(s) {', '.join(map(repr, unexpected))}; "
            f"expected {' or '.join(map(repr, sorted(fields)))}",
        )
    return value


def ids_of(body: Mapping[str, Any]) -> list[str]:
    """The body's ``"ids"``: a non-empty list of at most :data:`MAX_IDS` id strings,
    without repeats."""
    ids = body.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise Problem(422, '"ids" must be a non-empty list of envelope id strings')
    if len(ids) > MAX_IDS:
        raise Problem(422, f'"ids" holds {len(ids)} ids; at most {MAX_IDS} per request')
    return list(dict.fromkeys(ids))
