"""Publishing inside the caller's database transaction: what ``publish(connection=)`` needs.

A :class:`TransactionalPublisher` writes envelopes through a database connection the
caller holds, inside the transaction the caller opened on it, so the envelopes exist if
and only if that transaction commits. Two things are one: a transport whose broker *is*
that database (``PostgresTransport`` writes its message rows), and an outbox given to
the bus (``Bus(outbox=PostgresOutbox(dsn))``), which writes a row that its relay
forwards to whatever transport the bus uses once the transaction has committed.

:class:`Transactional` is the bus's side: which writer a ``publish(connection=)`` goes
through (chosen once, when the bus is made), the outbox's relay run while the bus
runs, and the count of what waits in the outbox, for the bus's statistics.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from anyio.abc import TaskGroup

from ._envelope import Envelope, Receipt
from ._exceptions import ConfigurationError
from ._options import PublishOptions
from ._time.due import guarded
from .transports._codec import Codec, default_codec

if TYPE_CHECKING:
    from ._publishing import Publisher

__all__ = ["Outbox", "Transactional", "TransactionalPublisher"]

#: How an outbox's relay hands a committed envelope to the bus.
Forward = Callable[[Envelope], Awaitable[object]]


@runtime_checkable
class TransactionalPublisher(Protocol):
    """Something that can write a publish inside the caller's open transaction."""

    async def publish_in(self, connection: Any, topic: str, envelopes: Sequence[Envelope]) -> None:
        """Write ``envelopes`` (all on ``topic``) through ``connection``, inside the
        transaction the caller opened on it: they are published if and only if it commits.

        :raises ConfigurationError: when ``connection`` is not one this writer can use
            (another database client's, or one not inside a transaction).
        """


@runtime_checkable
class Outbox(TransactionalPublisher, Protocol):
    """A :class:`TransactionalPublisher` for any transport (``Bus(outbox=...)``): what
    it writes in the caller's transaction, its relay forwards through the bus once
    committed. The bus attaches it once, opens it when it starts, runs :meth:`relay`
    in its task group and closes it when it stops."""

    @property
    def known_pending(self) -> int | None:
        """Committed envelopes waiting for a relay, as the relay last knew it, read
        without asking the database (``None`` before the bus first started)."""

    def attach(self, codec: Codec) -> None:
        """Become the outbox of one bus, whose payloads ``codec`` encodes.

        :raises ConfigurationError: when it is another bus's outbox already.
        """

    async def open(self) -> None:
        """Connect and make the outbox's tables if they are missing (the bus starts).

        :raises ConnectError: when the database cannot be reached.
        """

    async def relay(self, forward: Forward, running: Callable[[], bool]) -> None:
        """Forward committed envelopes, in order, through ``forward`` while ``running()``."""

    async def aclose(self) -> None:
        """Close the outbox's connections (the bus stops)."""


class Transactional:
    """A bus's ``publish(connection=)``: the writer it goes through, and the relay.

    :param outbox: ``Bus(outbox=)``; when ``None``, the transport writes, if it can.
    """

    def __init__(
        self, publisher: Publisher, outbox: object | None, transport: object, codec: object | None
    ) -> None:
        self._publisher = publisher
        self.outbox: Outbox | None = None
        self.writer: TransactionalPublisher | None = None
        if outbox is not None:
            if not isinstance(outbox, Outbox):
                raise ConfigurationError(
                    f"Bus: outbox must be an outbox such as PostgresOutbox(dsn), got {outbox!r}"
                )
            outbox.attach(default_codec() if codec is None else codec)  # type: ignore[arg-type]
            self.outbox = self.writer = outbox
        elif isinstance(transport, TransactionalPublisher):
            self.writer = transport

    async def open(self, stack: AsyncExitStack) -> None:
        """Open the outbox (if any) for this run of the bus; ``stack`` closes it."""
        if self.outbox is not None:
            await self.outbox.open()
            stack.push_async_callback(self.outbox.aclose)

    def start(self, tasks: TaskGroup, running: Callable[[], bool]) -> None:
        """Run the outbox's relay (if any) in ``tasks`` (the bus's) while ``running()``."""
        if self.outbox is not None:
            tasks.start_soon(
                guarded, self.outbox.relay, self._forward, running, name="asyncbus outbox"
            )

    def pending(self) -> int | None:
        """``statistics().outbox_pending``: what the outbox's relay last knew waits in it;
        ``None`` without an outbox."""
        return None if self.outbox is None else self.outbox.known_pending

    def _forward(self, envelope: Envelope) -> Awaitable[Receipt]:
        """Send an envelope the outbox kept as the publish it was (same id)."""
        return self._publisher.send("publish", envelope, None)

    async def publish(
        self, topic: str, payload: Any, options: PublishOptions, connection: Any, later: bool
    ) -> Receipt:
        """``Bus.publish(connection=)``: one envelope written through ``connection``."""
        writer = self._writer(f"publish({topic!r})", later)
        envelope = self._publisher.build_one(topic, payload, options)
        await writer.publish_in(connection, topic, (envelope,))
        return Receipt(envelope.id)

    async def publish_many(
        self,
        topic: str,
        payloads: Iterable[Any],
        options: PublishOptions,
        connection: Any,
        later: bool,
    ) -> list[Receipt]:
        """``Bus.publish_many(connection=)``: the envelopes written through ``connection``."""
        writer = self._writer(f"publish_many({topic!r})", later)
        envelopes = self._publisher.build_many(topic, payloads, options)
        if envelopes:
            await writer.publish_in(connection, topic, envelopes)
        return [Receipt(envelope.id) for envelope in envelopes]

    def _writer(self, where: str, later: bool) -> TransactionalPublisher:
        if later:
            raise ConfigurationError(
                f"{where}: connection= cannot be combined with delay= or at=: publish it "
                "in the transaction now and delay it where it is handled (Defer), or "
                "publish it later without connection="
            )
        if self.writer is None:
            raise ConfigurationError(
                f"{where}: connection= needs a bus that can write in your transaction: "
                "use PostgresTransport(dsn) as the transport, or give the bus an outbox "
                "with Bus(..., outbox=PostgresOutbox(dsn))"
            )
        return self.writer
