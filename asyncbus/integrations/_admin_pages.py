"""The admin app's pages and its token: the dashboard and AsyncAPI pages served with
strict headers, the page a browser without the token is shown, and the ASGI middleware
that asks every request for the token (the probes excepted)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import html
import importlib.resources
import re

from starlette.requests import HTTPConnection
from starlette.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["ASYNCAPI_PAGE", "AUTHORISED", "DASHBOARD", "PROBES", "BearerAuth"]

#: Routes served without the token: probes reveal nothing but status and a fixed reason.
PROBES = frozenset({"/healthz", "/readyz"})
#: Key in the request's state: the probe's caller presented the token.
AUTHORISED = "asyncbus_authorised"
#: Pages a browser opens: they also take the token as ``?token=`` (and send it on).
PAGES = frozenset({"", "/", "/asyncapi"})


class BearerAuth:
    """ASGI middleware: every request needs ``Authorization: Bearer <token>``.

    The pages (the dashboard, the AsyncAPI page) also take ``?token=``, so a browser can
    open them; their scripts send the token on as a header. The probes answer anyone.
    """

    def __init__(self, app: ASGIApp, *, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        connection = HTTPConnection(scope)
        scheme, _, credentials = connection.headers.get("authorization", "").partition(" ")
        presented: str | None = credentials.strip() if scheme.lower() == "bearer" else None
        if route_path(scope) in PROBES:
            # Open to anyone; the token holder is also told the detail of a failure.
            authorised = presented is not None and self._matches(presented)
            # (A new state: the one in the scope may be shared with other requests.)
            scope = {**scope, "state": {**scope.get("state", {}), AUTHORISED: authorised}}
            await self.app(scope, receive, send)
            return
        page = route_path(scope) in PAGES
        if presented is None and page:
            presented = connection.query_params.get("token")
        if presented is not None and self._matches(presented):
            await self.app(scope, receive, send)
            return
        if page and "text/html" in connection.headers.get("accept", ""):
            # A person with a browser: a page that says what to do, not JSON.
            await locked_page(
                scope.get("root_path", "") + (route_path(scope) or "/"), bool(presented)
            )(scope, receive, send)
            return
        message = "wrong bearer token" if presented else "missing bearer token"
        response = JSONResponse(
            {"error": f"{message}: send 'Authorization: Bearer <token>'"},
            status_code=401,
            headers={"WWW-Authenticate": 'Bearer realm="asyncbus"'},
        )
        await response(scope, receive, send)

    def _matches(self, presented: str) -> bool:
        return hmac.compare_digest(presented.encode(), self.token)


def route_path(scope: Scope) -> str:
    """The request's path below the mount point (what starlette's routing matches)."""
    # The path below the mount point (what starlette's routing matches against).
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :]
    return path


# -- the pages ----------------------------------------------------------------------


def page_headers(html: str) -> dict[str, str]:
    """Strict headers for a page of ours: its one inline ``<style>`` (and ``<script>``,
    if it has one) allowed by hash, nothing else."""

    def digest(tag: str) -> str:
        match = re.search(rf"<{tag}>(.*?)</{tag}>", html, re.DOTALL)
        if match is None:
            return "'none'"
        return f"'sha256-{base64.b64encode(hashlib.sha256(match[1].encode()).digest()).decode()}'"

    policy = (
        f"default-src 'none'; script-src {digest('script')}; style-src {digest('style')}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return {
        "Content-Security-Policy": policy,
        "Cache-Control": "no-store",
        "Referrer-Policy": "no-referrer",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
    }


def load_page(name: str) -> tuple[str, dict[str, str]]:
    """The page ``name`` of this package: its HTML and the headers to serve it with."""
    html = importlib.resources.files(__package__).joinpath(name).read_text("utf-8")
    for tag in ("script", "style"):
        if f"<{tag}>" not in html:  # pragma: no cover - the file ships with the package
            raise RuntimeError(f"asyncbus {name} has no <{tag}> element")
    return html, page_headers(html)


DASHBOARD = load_page("dashboard.html")
ASYNCAPI_PAGE = load_page("asyncapi.html")

#: What a browser that opened the dashboard without the right token is shown.
LOCKED_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>asyncbus dashboard: {title}</title>
<style>
body {{ font: 15px/1.5 system-ui, sans-serif; max-width: 40rem; margin: 3rem auto;
  padding: 0 1.5rem; color-scheme: light dark; }}
code {{ font-size: .9em; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>{what}</p>
<p>This dashboard is locked with the token its application gave to
<code>admin_app(bus, token=...)</code> (often read from an environment variable, such as
<code>ADMIN_TOKEN</code>). Open it with that token at the end of the address:</p>
<p><code>{path}?token=&lt;token&gt;</code></p>
<p>The page passes the token on to the API it polls. Scripts and API clients send it as a
header instead: <code>Authorization: Bearer &lt;token&gt;</code>.</p>
</body>
</html>
"""


def locked_page(path: str, wrong: bool) -> HTMLResponse:
    """The 401 page of a browser that came without the token, or with another one."""
    if wrong:
        title, what = "Wrong token", "The token in the address is not this dashboard's."
    else:
        title, what = "Token needed", "The address has no token, and this dashboard needs one."
    page = LOCKED_PAGE.format(title=title, what=what, path=html.escape(path))
    headers = {**page_headers(page), "WWW-Authenticate": 'Bearer realm="asyncbus"'}
    return HTMLResponse(page, status_code=401, headers=headers)
