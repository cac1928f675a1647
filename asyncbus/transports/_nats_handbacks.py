"""Hand-backs of the NATS transport: deliveries given back unhandled, which are no attempt.

JetStream counts every delivery of a message to a consumer (``num_delivered``), also
the one a consumer gave back with a ``nak`` because its bus was shutting down (or its
subscription ended). Those must not count toward ``max_deliveries``, or a service
restarted ten times would dead-letter healthy messages as poison. A ``nak`` cannot
carry a mark, so before it the consumer records the hand-back in the KV bucket
``{stream}_HANDBACKS``: key ``{consumer}.{stream sequence}``, value the number of
hand-backs of that message to that consumer. A message delivered before is checked
against it: ``num_delivered`` minus the hand-backs is what counts, toward the cap and
to tell a suspect (a message a consumer died or hung with) from a message merely given
back. (A first delivery costs no lookup.) Records expire after :data:`TTL`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from ._nats_kv import KvBucket, NatsHost

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js.kv import KeyValue


__all__ = ["TTL", "HandBacks"]

logger = logging.getLogger("asyncbus.transport.nats")

#: Seconds a hand-back is remembered: a message given back is delivered again at once
#: while its group has a consumer; one that waits longer may count it as a delivery.
TTL = 7 * 24 * 3600.0


def _count(value: bytes | None) -> int:
    text = (value or b"").decode("ascii", "replace")
    return int(text) if text.isdigit() and len(text) <= 9 else 0  # else: not ours


class HandBacks:
    """The hand-backs recorded for the consumers of ``transport``'s stream."""

    def __init__(self, transport: NatsHost) -> None:
        self._bucket = KvBucket(
            transport,
            f"{transport.stream}_HANDBACKS",
            ttl=TTL,
            description="asyncbus deliveries given back unhandled (no attempt)",
        )

    async def record(self, consumer: str, msgs: list[Msg]) -> None:
        """Count one more hand-back of each message to ``consumer`` (before the naks).

        Best effort: a hand-back that cannot be recorded counts as a delivery.
        """
        from nats.js.errors import KeyNotFoundError

        async def add(kv: KeyValue, key: str) -> None:
            try:
                entry = await kv.get(key)
                count = _count(entry.value)
            except KeyNotFoundError:
                count = 0
            await kv.put(key, str(count + 1).encode())

        async def record(kv: KeyValue) -> None:
            keys = [f"{consumer}.{msg.metadata.sequence.stream}" for msg in msgs]
            await asyncio.gather(*(add(kv, key) for key in keys))

        if not msgs:
            return
        try:
            await self._bucket.call(record)
        except Exception as error:  # deliberate: the naks go out whatever happens here
            logger.warning(
                "NATS: could not record %d hand-back(s) of %s (they count as deliveries): %s",
                len(msgs),
                consumer,
                error,
            )

    async def count(self, consumer: str, sequence: int) -> int:
        """Hand-backs recorded for message ``sequence`` of ``consumer`` (0 when unknown)."""
        from nats.js.errors import KeyNotFoundError

        async def count(kv: KeyValue) -> int:
            try:
                entry = await kv.get(f"{consumer}.{sequence}")
            except KeyNotFoundError:
                return 0
            return _count(entry.value)

        try:
            return await self._bucket.call(count)
        except Exception as error:  # then every delivery counts
            logger.warning("NATS: could not read the hand-backs of %s: %s", consumer, error)
            return 0
