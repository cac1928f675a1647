"""The worker the deployment examples run: ``asyncbus run worker:bus``.

Settings come from the environment: ``REDIS_URL`` (default: Redis on this machine) and
``ORDERS_PREFIX`` (the prefix of every Redis key, default ``shop``).
"""

from __future__ import annotations

import logging
import os

from asyncbus import Adaptive, Bus
from asyncbus.transports import RedisTransport

logger = logging.getLogger("orders")

bus = Bus(
    transport=RedisTransport(
        os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        prefix=os.environ.get("ORDERS_PREFIX", "shop"),
    ),
    name="orders-worker",
)


# An explicit group: the default one is the handler's module:qualname, so renaming the
# function (or its module) would bind a new group and leave the old one in the broker.
@bus.subscribe("orders.created", group="fulfilment", concurrency=Adaptive(min=1, max=32))
async def fulfil(order: dict[str, int]) -> None:
    """Fulfil one order (here: say so)."""
    logger.info("fulfilled order %s", order["id"])
