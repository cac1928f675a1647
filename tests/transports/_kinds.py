"""The three broker transports by name, for tests that run the same case on each."""

from __future__ import annotations

import contextlib
from typing import Any

from asyncbus.transports import Transport

__all__ = ["SHARED_PORTS", "forget", "make_transport", "url_for"]

#: Ports of the shared loopback brokers.
SHARED_PORTS = {"redis": 6379, "nats": 4222, "rabbit": 5672}


def url_for(kind: str, port: int) -> str:
    """The URL of a ``kind`` broker listening on 127.0.0.1:``port``."""
    return {
        "redis": f"redis://127.0.0.1:{port}/0",
        "nats": f"nats://127.0.0.1:{port}",
        "rabbit": f"amqp://guest:guest@127.0.0.1:{port}/",
    }[kind]


def make_transport(kind: str, url: str, prefix: str, **options: Any) -> Transport:
    """A ``kind`` transport on ``url`` under ``prefix``, with the given constructor options."""
    if kind == "redis":
        from asyncbus.transports.redis import RedisTransport

        return RedisTransport(url, prefix=prefix, **options)
    if kind == "nats":
        from asyncbus.transports.nats import NatsTransport

        return NatsTransport(url, prefix=prefix, **options)
    from asyncbus.transports.rabbit import RabbitTransport

    return RabbitTransport(url, prefix=prefix, **options)


async def forget(kind: str, url: str, prefix: str) -> None:
    """Delete everything a test left in the broker under ``prefix``."""
    if kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)
        try:
            keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
            if keys:
                await client.delete(*keys)
        finally:
            await client.aclose()
    elif kind == "nats":
        import nats
        import nats.js.errors

        client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
        try:
            js = client.jetstream()
            streams = await js.streams_info()
            mine = prefix.upper()
            for info in streams:
                if info.config.name.startswith((mine, f"KV_{mine}")):
                    with contextlib.suppress(nats.js.errors.NotFoundError):
                        await js.delete_stream(info.config.name)
        finally:
            await client.close()
    else:
        from asyncbus.transports.rabbit import RabbitTransport

        await RabbitTransport(url, prefix=prefix).delete_everything()
