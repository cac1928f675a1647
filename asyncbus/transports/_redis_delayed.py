"""Delayed retries in Redis: written by a delayed nack, moved back to their streams when due.

``{prefix}:delayed`` is a sorted set of retries by due time (ms), each one a hash
``{prefix}:delayed:{token}`` (stream, meta, body); ``{prefix}:delayed:counts`` counts
them per stream (for the backlog). A task of every transport moves the due ones back
with a Lua script (``MOVE_DUE``), so any live process does it; a retry of this process
due before the mover's next look wakes it.

On a cluster whose bindings spread over slots, a binding's retries stay in its slot:
the sorted set ``{stream}:delayed`` and its items ``{stream}:delayed:{token}`` (their
count is its ``ZCARD``). The prefix's ``{prefix}:delayed:due`` indexes the bindings
with retries by when the first is due: a delayed nack lowers its binding's score
(``ZADD LT``) before and after writing the retry, and the mover reads the index, moves
each due binding's retries (``MOVE_DUE_OF_BINDING``), writes the binding's next time
and looks at the binding again, so a retry written meanwhile is indexed. What a cut
could still leave out (a process killed between the retry and its second ``ZADD``, or
the index's master failing over without them) the mover finds every
``_REPAIR_EVERY`` seconds: it looks at every registered binding's first retry and
lowers the index to it.
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
from ._redis_bindings import text
from ._redis_dedup import RedisHost

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
#: Seconds between two looks of the mover at every binding's first retry (on a cluster).
_REPAIR_EVERY = 5.0


class DelayedHost(RedisHost, Protocol):
    """What the delayed retries use of their transport (:class:`~.redis.RedisTransport`)."""

    _delayed_key: str
    _delayed_counts_key: str
    _delayed_index_key: str
    _bindings_key: str
    #: The registered scripts of :mod:`._redis_scripts`, by name.
    _scripts: dict[str, AsyncScript]

    def delayed_key_of(self, stream: str) -> str:
        """The sorted set of delayed retries ``stream``'s are in."""
        ...


class DelayedRetries:
    """The delayed retries of ``transport``'s prefix: queued, and moved back when due."""

    def __init__(self, transport: DelayedHost) -> None:
        self.transport = transport
        #: When the mover looks next (epoch seconds).
        self.next_due = float("inf")
        #: When the mover last looked at every binding's first retry (monotonic).
        self._repaired_at = -_REPAIR_EVERY
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
        delayed_key = transport.delayed_key_of(stream)
        item = f"{delayed_key}:{secrets.token_hex(12)}"
        pipe.hset(item, mapping={"stream": stream, "meta": meta, "body": body})
        pipe.zadd(delayed_key, {item: _ms(due)})  # never early
        if transport.cluster:
            return due  # (counted by the binding's own set)
        # Not HINCRBY: a count another client garbled must not fail the nack.
        # EVAL, not the registered script: a pipeline would check that the
        # server has it first (another round trip), and a cluster's pipeline
        # does not load it on the node.
        pipe.eval(_redis_scripts.COUNT_DELAYED, 1, transport._delayed_counts_key, stream)
        return due

    async def index(self, stream: str, due: float) -> None:
        """Have the index of bindings with retries (on a cluster) name ``stream`` by
        ``due`` at the latest."""
        transport = self.transport
        await transport._redis().zadd(transport._delayed_index_key, {stream: _ms(due)}, lt=True)

    async def index_again(self, stream: str, due: float) -> None:
        """:meth:`index` once the retry is written: shielded (a cancellation now would
        leave it to the mover's next repair), a failure logged, not raised (the retry
        and its ack are written; the repair indexes it)."""
        with anyio.CancelScope(shield=True):
            try:
                await self.index(stream, due)
            except Exception as error:
                logger.warning(
                    "Redis: indexing a delayed retry of %s failed (the mover finds it "
                    "within %g s): %s",
                    stream,
                    _REPAIR_EVERY,
                    error,
                )

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
                if transport.cluster:
                    reply = await self._move_spread()
                else:
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

    async def _move_spread(self) -> list[Any]:
        """Move the due retries of every binding the index names as due (a cluster whose
        bindings spread over slots); ``MOVE_DUE``'s reply: {moved, next due or none}."""
        transport = self.transport
        client = transport._redis()
        index = transport._delayed_index_key
        if time.monotonic() - self._repaired_at >= _REPAIR_EVERY:
            await self._repair_index(client)
        now = int(time.time() * 1000)
        moved = 0
        due: list[Any] = await client.zrangebyscore(index, "-inf", now, start=0, num=_DELAY_BATCH)
        for found in due:
            stream = text(found)
            delayed_key = transport.delayed_key_of(stream)
            reply = await transport._scripts["MOVE_DUE_OF_BINDING"](
                keys=[delayed_key, stream], args=[now, _DELAY_BATCH]
            )
            moved = max(moved, int(reply[0]))
            if len(reply) > 1:
                await client.zadd(index, {stream: float(reply[1])}, xx=True)
            else:
                await client.zrem(index, stream)
            # A retry written since the script ran may have had its time overwritten (or
            # its binding taken off): the binding's first retry puts it back.
            first = await client.zrange(delayed_key, 0, 0, withscores=True)
            if first:
                await client.zadd(index, {stream: float(first[0][1])}, lt=True)
        after = await client.zrange(index, 0, 0, withscores=True)
        return [moved, after[0][1]] if after else [moved]

    async def _repair_index(self, client: Any) -> None:
        """Lower the index to every registered binding's first retry (one pipeline, a
        round trip per master), so none is left out of it for good."""
        transport = self.transport
        streams = [text(found) for found in await client.hkeys(transport._bindings_key)]
        if streams:
            pipe = client.pipeline(transaction=False)
            for stream in streams:
                pipe.zrange(transport.delayed_key_of(stream), 0, 0, withscores=True)
            firsts = await pipe.execute()
            lower = {
                stream: float(first[0][1])
                for stream, first in zip(streams, firsts, strict=True)
                if first
            }
            if lower:
                await client.zadd(transport._delayed_index_key, lower, lt=True)
        self._repaired_at = time.monotonic()


def _ms(due: float) -> int:
    """``due`` (epoch seconds) in whole milliseconds, never early."""
    return math.ceil(due * 1000)
