"""How :class:`~.redis.RedisTransport` reaches its server: the URLs it takes, the client
it makes (one server's connection pool, or a cluster's client) and its first answer.

Commands are packed by hiredis when it is installed (redis-py packs in Python, an
argument at a time).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit

import anyio

from .._exceptions import ConfigurationError, ConnectError
from ._kit import redact, require_asyncio
from ._registry import registered

__all__ = [
    "CLOSE_TIMEOUT",
    "SCHEMES",
    "URL_FORM",
    "CaughtErrors",
    "check_nodes",
    "credentials",
    "open_client",
    "packing_by_hiredis",
    "socket_timeouts",
]

#: The URL schemes redis-py takes, and what a URL looks like (for errors).
SCHEMES = tuple(registered("redis").schemes)
URL_FORM = "redis://[[user]:password@]host[:port][/db] (rediss:// for TLS, unix:///path)"

_EXTRA_MISSING = "RedisTransport needs the 'redis' extra: pip install 'asyncbus[redis]'"
#: Seconds closing the connections may take.
CLOSE_TIMEOUT = 0.5
#: Seconds the first answer (a PING) may take before connecting fails.
_CONNECT_WAIT = 10.0

#: Argument types hiredis packs exactly as redis-py's encoder writes them.
_AS_THEY_ARE = frozenset({bytes, int})


def packing_by_hiredis(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` packing its commands with hiredis (C) when it is installed.

    redis-py's asyncio connections pack a command in Python, growing one buffer an
    argument at a time: for a publish batch (a script call with a few hundred
    arguments) that cost more than everything else the transport does for those
    envelopes. The arguments are still encoded by the connection's own encoder (the
    same bytes on the wire, the same errors for a bad argument); only the framing
    moves to hiredis. Without hiredis the class is returned as it is.
    """
    try:
        from hiredis import pack_command as pack
    except ImportError:
        return connection_class

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        head = args[0]
        if isinstance(head, str):
            args = (*head.encode().split(), *args[1:])
        elif b" " in head:
            args = (*head.split(), *args[1:])
        encode = self.encoder.encode
        # Bytes and ints (not bools) are written as the encoder would write them.
        return [pack(tuple([arg if type(arg) in _AS_THEY_ARE else encode(arg) for arg in args]))]

    return type(
        f"HiredisPacked{connection_class.__name__}",
        (connection_class,),
        {"pack_command": pack_command, "__doc__": connection_class.__doc__},
    )


def _as_it_came(response: Any, **options: Any) -> Any:
    return response


class CaughtErrors:
    """redis-py's errors the transport catches: ``RedisError`` includes the cluster
    client's own (``RedisClusterException``: no node answers, a slot not covered)."""

    def __init__(self, errors: Any) -> None:
        self.RedisError = (errors.RedisError, errors.RedisClusterException)
        self.ResponseError = errors.ResponseError


def check_nodes(nodes: list[str], cluster: bool, prefix: object) -> None:
    """Refuse what cannot work with ``cluster`` (see :class:`~.redis.RedisTransport`)."""
    if not cluster:
        if len(nodes) > 1:
            shown = ",".join(redact(one) for one in nodes)
            raise ConfigurationError(
                "RedisTransport: several URLs name the nodes of a Redis Cluster: pass "
                f"cluster=True (one server takes one URL), got {shown!r}"
            )
        return
    for one in nodes:
        parts = urlsplit(one)
        if parts.scheme not in ("redis", "rediss") or parts.path not in ("", "/", "/0"):
            raise ConfigurationError(
                "RedisTransport: a cluster node is redis://[[user]:password@]host[:port] "
                f"(rediss:// for TLS; database 0, the only one a cluster has), got {redact(one)!r}"
            )
    if isinstance(prefix, str) and ("{" in prefix or "}" in prefix):
        raise ConfigurationError(
            "RedisTransport: on a cluster the prefix becomes the keys' hash tag and "
            f"cannot hold braces, got {prefix!r}"
        )


def credentials(url: str) -> dict[str, Any]:
    """redis-py's ``username``, ``password`` and ``ssl`` for the node at ``url``."""
    parts = urlsplit(url)
    return {
        "username": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else None,
        "ssl": parts.scheme == "rediss",
    }


def _cluster_client(nodes: list[str], retry: Any, timeouts: dict[str, float]) -> Any:
    """redis-py's cluster client, starting from ``nodes`` (credentials of the first)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    startup = []
    for one in nodes:
        parts = urlsplit(one)
        startup.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
    return RedisCluster(
        startup_nodes=startup,
        **credentials(nodes[0]),
        retry=retry,
        socket_connect_timeout=timeouts["socket_connect_timeout"],
        socket_timeout=timeouts["socket_timeout"],
    )


def socket_timeouts(publish_timeout: float, block_ms: int) -> dict[str, float]:
    """redis-py's socket timeouts of the transport's clients."""
    return {
        "socket_connect_timeout": min(5.0, publish_timeout),
        # Every call is bounded; a blocking read waits block_ms, well within it.
        "socket_timeout": max(publish_timeout, block_ms / 1000 + 1.0),
    }


async def open_client(
    nodes: list[str], *, cluster: bool, publish_timeout: float, block_ms: int, shown: str
) -> tuple[Any, CaughtErrors]:
    """A client of the server (or cluster) at ``nodes`` that answered a PING, and the
    errors of redis-py to catch (``shown``: the URLs, credentials hidden, for errors).

    :raises ConnectError: when redis-py is missing, the server does not answer, or
        not running on asyncio.
    :raises ConfigurationError: for a URL redis-py cannot read (an unknown scheme).
    """
    try:
        import redis.asyncio as aioredis
        import redis.exceptions as errors
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
    except ImportError as error:
        raise ConnectError(_EXTRA_MISSING) from error
    require_asyncio("RedisTransport", "redis-py")
    # A few quick retries on a broken connection: a server that restarted leaves
    # pooled connections dead, and the first command on each must not fail for it.
    # Not on a timeout: a server that stopped answering fails the call at once.
    retry = Retry(
        ExponentialBackoff(cap=0.5, base=0.05), 3, supported_errors=(errors.ConnectionError,)
    )
    timeouts = socket_timeouts(publish_timeout, block_ms)
    client: Any
    if cluster:
        client = _cluster_client(nodes, retry, timeouts)
    else:
        # A blocking pool: a burst of concurrent publishes waits for a connection
        # instead of failing with "Too many connections".
        try:
            pool = aioredis.BlockingConnectionPool.from_url(
                ",".join(nodes), max_connections=256, timeout=None, retry=retry, **timeouts
            )
        except ValueError as error:  # a URL redis-py cannot read (an unknown scheme)
            raise ConfigurationError(
                f"RedisTransport: {error}, got {shown!r}: write it like {URL_FORM}"
            ) from error
        pool.connection_class = packing_by_hiredis(pool.connection_class)
        client = aioredis.Redis.from_pool(pool)
    # XREADGROUP's reply as it came (lists, or a map on RESP3), read by the consumer's
    # fetch alone: redis-py's parsing made a dict per entry.
    client.set_response_callback("XREADGROUP", _as_it_came)
    try:
        with anyio.fail_after(_CONNECT_WAIT):
            await client.ping()
    except BaseException as error:  # deliberate: close the client on any way out
        with anyio.CancelScope(shield=True), anyio.move_on_after(CLOSE_TIMEOUT):
            await client.aclose()
        if not isinstance(
            error, errors.RedisError | errors.RedisClusterException | OSError | TimeoutError
        ):
            raise
        reason = str(error) or f"{type(error).__name__}: no answer within {_CONNECT_WAIT:g} s"
        raise ConnectError(f"cannot connect to Redis at {shown}: {reason}") from (error)
    return client, CaughtErrors(errors)
