"""On a Redis Cluster, the master that holds a transport's keys, reached directly.

``WAIT`` counts the replicas that have the writes made *on its own connection*. A
cluster client picks a connection per command, so a write and its ``WAIT`` cannot be
kept together through it. :class:`PrefixMaster` keeps a plain client of the master of
a write's slot (a binding's stream, or the prefix's shared keys): the transport writes
there and waits there, on one connection.

When the master is gone (a failover) or the slot moved, the cluster client is asked
for the key's slot once (its own redirection and topology refresh find the new
master), and the write is tried again, within the publish's time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from ._redis_connection import credentials

__all__ = ["PrefixMaster"]

#: Seconds between two tries of a write whose master is gone or moved.
_RETRY_PAUSE = 0.25


class PrefixMaster:
    """A plain client of the master serving ``key``'s slot, made from ``nodes``'
    credentials (the first URL's, as the cluster client), one per master met.

    :param timeouts: redis-py's socket timeouts, as the cluster client has them.
    """

    def __init__(self, nodes: list[str], key: str, timeouts: dict[str, float]) -> None:
        self._options: dict[str, Any] = {**credentials(nodes[0]), **timeouts}
        self._key = key
        self._clients: dict[tuple[str, int], Any] = {}

    def client_of(self, cluster: Any, key: str | None = None) -> Any:
        """The client of the master the cluster client sends ``key`` (the prefix's by
        default) to now."""
        import redis.asyncio as aioredis

        node = cluster.get_node_from_key(key or self._key)
        address = (node.host, int(node.port))
        client = self._clients.get(address)
        if client is None:
            client = aioredis.Redis(host=address[0], port=address[1], **self._options)
            self._clients[address] = client
        return client

    async def on_master(
        self,
        cluster: Any,
        write: Callable[[Any], Awaitable[Any]],
        within: float,
        *,
        key: str | None = None,
    ) -> Any:
        """``write(client)`` on the master of ``key`` (the prefix's by default); tried
        again every 0.25 s while the master cannot be reached or no longer serves the
        slot, for ``within`` seconds.

        A write cut off by a lost connection may have reached the server: tried again,
        it is written twice (at-least-once, as every publish interrupted that way).
        """
        import redis.exceptions as errors

        moved = (
            errors.ConnectionError,
            errors.MovedError,
            errors.AskError,
            errors.ClusterDownError,
            errors.TryAgainError,
            errors.ReadOnlyError,
        )
        deadline = anyio.current_time() + within
        while True:
            try:
                return await write(self.client_of(cluster, key))
            except moved:
                if anyio.current_time() + _RETRY_PAUSE >= deadline:
                    raise
            await self._refresh(cluster, key or self._key)
            await anyio.sleep(_RETRY_PAUSE)

    async def _refresh(self, cluster: Any, key: str) -> None:
        """Ask the cluster client about the key: on its way it follows a redirection or
        refreshes its map of the cluster; whether it answers is not the point."""
        import redis.exceptions as errors

        try:
            with anyio.move_on_after(_RETRY_PAUSE * 4):
                await cluster.exists(key)
        except (errors.RedisError, errors.RedisClusterException, OSError):
            pass  # the next try says what is wrong

    async def aclose(self) -> None:
        """Close every client made (shielded: sockets are closed locally)."""
        clients, self._clients = list(self._clients.values()), {}
        with anyio.CancelScope(shield=True):
            for client in clients:
                await client.aclose()
