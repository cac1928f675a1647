"""The checks every broker transport makes: when it is created (its URL, its client
library) and when it connects (the event loop its client runs on)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from urllib.parse import urlsplit

from ..._exceptions import ConfigurationError, ConnectError
from ..._runtime import current_backend
from .._registry import registered_schemes
from .redact import redact

__all__ = ["MissingExtra", "check_url", "require_asyncio", "require_extra"]


def require_asyncio(transport: str, client: str) -> None:
    """Refuse to connect anywhere but on asyncio (plain or uvloop).

    :param transport: the transport's class name, for the message.
    :param client: the client library that needs asyncio.
    :raises ConnectError: (a :class:`~asyncbus.TransportError`) on another backend.
    """
    library = current_backend()
    if library != "asyncio":
        raise ConnectError(
            f"{transport} runs on asyncio only ({client}), not {library}: "
            "use anyio's asyncio backend"
        )


class MissingExtra(ConnectError, ConfigurationError, ImportError):
    """A transport's client library is not installed: the message names the extra.

    Raised when the transport is created. A :class:`~asyncbus.ConnectError`, what
    ``connect`` raised for it before (it still does, for a library that fails to
    import); an :class:`ImportError`, as for the integrations' extras; and a
    :class:`~asyncbus.ConfigurationError`, as for any setting that cannot work.
    """


def require_extra(transport: str, extra: str, *packages: str) -> None:
    """Refuse to create ``transport`` when a top-level package of ``extra`` is missing.

    Only looked up (:func:`importlib.util.find_spec`), never imported: a transport's
    client library is imported when it connects. A package blocked in
    ``sys.modules`` (``None``) counts as missing.

    :raises MissingExtra: naming the extra to install (``pip install 'asyncbus[nats]'``).
    """
    for package in packages:
        try:
            found = importlib.util.find_spec(package) is not None
        except (ImportError, ValueError):  # a broken package, a module without a spec
            found = False
        if not found:
            raise MissingExtra(
                f"{transport} needs the '{extra}' extra: pip install 'asyncbus[{extra}]'"
            )


def split_urls(url: str | Sequence[str]) -> list[str]:
    """The URLs of ``url`` (one, several separated by commas, or a sequence), stripped;
    ``url`` passed :func:`check_url`."""
    urls = url.split(",") if isinstance(url, str) else url
    return [one.strip() for one in urls]


def check_url(transport: str, url: object, schemes: Sequence[str], form: str) -> None:
    """Refuse a broker URL that cannot work, as the transport is created.

    ``url`` is one URL, several separated by commas, or a sequence of them; each must
    be a string with a scheme (not another broker's, nor the web's: one of
    ``schemes``, or one the client library may know), without whitespace, and when it
    names a port, a number from 0 to 65535. (The client libraries would fail only on
    connecting, with their own raw errors, or take a URL without a scheme for a host
    name.)

    :param form: what a URL looks like, for the message (``nats://host:port``).
    :raises ConfigurationError: naming the URL (without its credentials) and ``form``.
    """
    urls = url.split(",") if isinstance(url, str) else url
    if (
        isinstance(urls, str | bytes)
        or not isinstance(urls, Sequence)
        or not urls
        or not all(isinstance(one, str) and one.strip() for one in urls)
    ):
        shown = repr(redact(url)) if isinstance(url, str) else repr(url)
        raise ConfigurationError(f"{transport}: url must be a string like {form}, got {shown}")
    for one in urls:
        problem = _url_problem(one.strip(), schemes)
        if problem is not None:
            raise ConfigurationError(
                f"{transport}: {problem} in url {redact(one.strip())!r}: write it like {form}"
            )


#: Schemes that name another broker or the web: a URL with one of them is a mix-up.
#: (Any other scheme is left to the client library, which reports it on connecting.)
_OTHER_SCHEMES = registered_schemes() | {"http", "https"}


def _url_problem(url: str, schemes: Sequence[str]) -> str | None:
    scheme, separator, rest = url.partition("://")
    if not separator:
        return f"no scheme ({' or '.join(f'{name}://' for name in schemes)})"
    if scheme.lower() in _OTHER_SCHEMES and scheme.lower() not in schemes:
        return f"scheme {scheme!r} is not {' or '.join(repr(name) for name in schemes)}"
    try:
        urlsplit(url).port  # noqa: B018  (parsing is the check)
    except ValueError as error:  # a port that is no number, or out of range
        return f"a bad port ({error})"
    if any(character.isspace() for character in rest):
        return "whitespace"
    return None
