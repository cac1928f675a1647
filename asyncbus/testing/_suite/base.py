"""The conformance suite's settings and the checks its parts share (skips by
capability, the backlog polled under a deadline)."""

from __future__ import annotations

from typing import ClassVar

import anyio
import pytest

from ...transports.base import BacklogReader, DeadLetterStore, Transport
from .support import _check


class SuiteBase:
    """The settings a transport's test class may override, and what every part of
    :class:`~asyncbus.testing.transport_suite.TransportSuite` calls."""

    #: Seconds after which a dead consumer's deliveries go to another consumer;
    #: ``None`` when the transport has no such timeout (in-process transports).
    ack_timeout: ClassVar[float | None] = None
    #: Deadline in seconds of every wait for something that must arrive.
    timeout: ClassVar[float] = 10.0
    #: Seconds within which a consumer that leaves hands its deliveries to another.
    release_timeout: ClassVar[float] = 2.0
    #: Upper bound on how late a delayed ``nack`` may redeliver, beyond its delay.
    delay_slack: ClassVar[float] = 2.0
    #: Characters in the large-payload test's string payload (1 MiB).
    large_payload_size: ClassVar[int] = 1 << 20
    #: Bytes of the long topic and pattern tried where the transport states no limit.
    unlimited_name_bytes: ClassVar[int] = 16 * 1024

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        """Publish one envelope on ``topic`` whose body is ``body``, raw (override me).

        The envelope's metadata must be valid (a fresh id, ``topic``, attempt 1),
        only the body is taken as is, so the consumer sees a delivery whose
        ``error`` is set and whose payload is ``body``. Routing is the transport's
        as for :meth:`Transport.publish`. The default skips the test that needs it.
        """
        pytest.skip(f"{type(self).__name__} does not implement publish_raw")

    def _require(self, transport: Transport, capability: str) -> None:
        if not getattr(transport.capabilities, capability):
            pytest.skip(f"{type(transport).__name__} lacks capability {capability!r}")

    def _store(self, transport: Transport) -> DeadLetterStore:
        """The transport as a :class:`DeadLetterStore` (the test is skipped otherwise)."""
        if not isinstance(transport, DeadLetterStore):
            pytest.skip(f"{type(transport).__name__} keeps no dead letters")
        return transport

    async def _backlog_becomes(
        self, transport: BacklogReader, pattern: str, group: str, expected: int
    ) -> None:
        # A broker may apply an ack asynchronously: poll its count under a deadline.
        count = -1
        with anyio.move_on_after(self.timeout):
            while (count := await transport.backlog(pattern, group)) != expected:
                await anyio.sleep(0.02)
        _check(count, expected, f"backlog of ({pattern!r}, {group!r})")
