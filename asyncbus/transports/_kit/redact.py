"""Broker URLs as logs and errors show them: without credentials."""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["redact"]

#: Query options whose value is a secret (compared lower-cased).
_SECRET_OPTIONS = frozenset(
    {"password", "passwd", "pass", "token", "auth", "auth_token", "secret", "key"}
)
_HIDDEN = "***"


def redact(url: str) -> str:
    """``url`` with its credentials hidden, everything else as written.

    A password becomes ``***`` (``user:***@host``); a user name alone becomes
    ``***@host`` too, since some brokers take a token there (``nats://TOKEN@host``);
    secret query options (``password=``, ``token=``...) keep their name only. A URL
    without a scheme (``user:secret@host:4222``) loses everything before its last
    ``@``. Nothing is parsed beyond that, so a URL that would not connect (a bad
    port, say) is still shown, not raised on.
    """
    if "://" not in url:
        return f"{_HIDDEN}@{url.rpartition('@')[2]}" if "@" in url else url
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced "[" in the host: keep only what follows "://"
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{_HIDDEN}@{rest.rpartition('@')[2]}" if "@" in rest else url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        netloc = f"{user}:{_HIDDEN}@{host}" if colon and user else f"{_HIDDEN}@{host}"
    query = "&".join(_redact_option(option) for option in parts.query.split("&"))
    return parts._replace(netloc=netloc, query=query if parts.query else "").geturl()


def _redact_option(option: str) -> str:
    name, equals, _value = option.partition("=")
    return f"{name}={_HIDDEN}" if equals and name.lower() in _SECRET_OPTIONS else option
