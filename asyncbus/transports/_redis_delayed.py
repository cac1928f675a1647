"""Delayed retries in Redis: written by a delayed nack, moved back to their streams when due.

``{prefix}:delayed`` is a sorted set of retries by due time (ms), each one a hash
``{prefix}:delayed:{token}`` (stream, meta, body); ``{prefix}:delayed:counts`` counts
them per stream (for the backlog). A task of every transport moves the due ones back
with a Lua script (``MOVE_DUE``), so any live process does it; a retry of this process
due before the mover's next look wakes it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from . import _redis_scripts
from ._kit import Backoff

if TYPE_CHECKING:
    from redis.commands.core import AsyncScript

__all__ = ["DelayedHost", "DelayedRetries"]

logger = logging.getLogger("asyncbus.transport.redis")

#: Longest wait of the mover between two looks at the sorted set.
_DELAY_POLL = 0.1
#: Due retries moved per script call.
_DELAY_BATCH = 500
#: Longest pause of the mover after failures.
_BACKOFF_MAX = 2.0


class DelayedHost(Protocol):
    """What the delayed retries use of their transport (:class:`~.redis.RedisTransport`)."""

    _delayed_key: str
    _delayed_counts_key: str
    _bindings_key: str
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]


class DelayedRetries:
    """The delayed retries of ``transport``'s prefix: queued, and moved back when due."""

    def __init__(self, transport: DelayedHost) -> None:
        self.transport = transport
        #: When the mover looks next (epoch seconds).
        self.next_due = float("inf")
        # Made in ``open``, inside the event loop that uses it.
        self.wake: anyio.Event

    def open(self) -> None:
        """Make what the mover waits on (in the transport's event loop)."""
        self.wake = anyio.Event()

    def queue(self, pipe: Any, stream: str, meta: bytes, body: bytes, delay: float) -> float:
        """Add to ``pipe`` the writes of a retry of ``stream`` due in ``delay`` seconds;
        return when it is due (epoch seconds)."""
        transport = self.transport
        due = time.time() + delay
        item = f"{transport._delayed_key}:{secrets.token_hex(12)}"
        pipe.hset(item, mapping={"stream": stream, "meta": meta, "body": body})
        pipe.zadd(transport._delayed_key, {item: math.ceil(due * 1000)})  # never early
        # Not HINCRBY: a count another client garbled must not fail the nack.
        # EVAL, not the registered script: a pipeline would check that the
        # server has it first (another round trip), and a cluster's pipeline
        # does not load it on the node.
        pipe.eval(_redis_scripts.COUNT_DELAYED, 1, transport._delayed_counts_key, stream)
        return due

    async def move_due(self) -> None:
        """Move due delayed retries back to their streams (any process's, atomically)."""
        transport = self.transport
        wait = 0.0
        backoff = Backoff(0.05, _BACKOFF_MAX)
        loop = asyncio.get_running_loop()
        while True:
            self.next_due = time.time() + wait
            wake = self.wake
            if wait > 0:
                # A timer that sets the event, not a cancel scope with a deadline: a
                # scope that expires (ten times a second here) formats its task's repr.
                timer = loop.call_later(wait, wake.set)
                try:
                    await wake.wait()
                finally:
                    timer.cancel()
            else:
                await anyio.lowlevel.checkpoint()
            self.wake = anyio.Event()
            try:
                reply = await transport._scripts["MOVE_DUE"](
                    keys=[
                        transport._delayed_key,
                        transport._delayed_counts_key,
                        transport._bindings_key,
                    ],
                    args=[int(time.time() * 1000), _DELAY_BATCH],
                )
            except Exception as error:  # keep moving whatever went wrong once
                logger.warning("Redis: moving delayed retries failed: %s", error)
                wait = backoff.next()
                continue
            backoff.reset()
            moved = int(reply[0])
            if moved >= _DELAY_BATCH:
                wait = 0.0
            elif len(reply) > 1:
                wait = min(_DELAY_POLL, max(0.0, float(reply[1]) / 1000 - time.time()))
            else:
                wait = _DELAY_POLL
