"""The exceptions asyncbus raises, in one tree.

::

    AsyncbusError
    ├── ConfigurationError (also ValueError)   bad capacity / concurrency / attempts / pattern
    ├── BusClosedError (also RuntimeError)     publish before start or after aclose
    ├── PublishTimeout (also TimeoutError)     BLOCK stage stayed full past timeout
    ├── HandlerError                           .envelope .stage .attempts, __cause__ set
    ├── HandlerTimeout (also TimeoutError)     a handler outran its stage's timeout
    ├── Reject                                 raised by handlers: dead-letter now, no retry
    ├── BatchError                             raised by batch handlers: these positions failed
    ├── SerializationError ── EncodeError, DecodeError
    └── TransportError ── ConnectError

anyio's ``WouldBlock``, ``ClosedResourceError`` and ``EndOfStream`` are reused, not
redefined.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ._envelope import Envelope, Receipt

__all__ = [
    "AsyncbusError",
    "BatchError",
    "BusClosedError",
    "ConfigurationError",
    "ConnectError",
    "DecodeError",
    "EncodeError",
    "HandlerError",
    "HandlerTimeout",
    "PublishTimeout",
    "Reject",
    "SerializationError",
    "TransportError",
    "not_started",
]


class AsyncbusError(Exception):
    """Base class of every error asyncbus raises."""


class ConfigurationError(AsyncbusError, ValueError):
    """A subscription or bus was configured with values that cannot work."""


class BusClosedError(AsyncbusError, RuntimeError):
    """A publish was made before the bus started or after it began to close.

    :ivar receipt: for a publish the shutdown cut off while it waited for room, what
        earlier stages of its fan-out had admitted; ``None`` otherwise.
    :ivar receipts: for a ``publish_many`` cut off so, the receipts of the envelopes
        published before the one cut off (``receipt``); empty otherwise.
    """

    def __init__(
        self,
        message: str = "",
        *,
        receipt: Receipt | None = None,
        receipts: Sequence[Receipt] = (),
    ) -> None:
        super().__init__(message)
        self.receipt = receipt
        self.receipts: list[Receipt] = list(receipts)


class PublishTimeout(AsyncbusError, TimeoutError):
    """A ``BLOCK`` stage stayed full past the publish timeout.

    :ivar receipt: what was admitted before time ran out (earlier stages of a fan-out).
    :ivar receipts: for ``publish_many``, the receipts of the envelopes published
        before the one that timed out (``receipt``); those after it were not published.
        Empty for ``publish``.
    """

    def __init__(self, message: str, *, receipt: Receipt, receipts: Sequence[Receipt] = ()) -> None:
        super().__init__(message)
        self.receipt = receipt
        self.receipts: list[Receipt] = list(receipts)


def not_started(doing: str = "publish") -> BusClosedError:
    """The error of ``doing`` what needs the running bus before the bus started.

    It says how to start it, with ``async with`` and in a web app: a module-level bus
    in a FastAPI or Starlette app is run by the app's lifespan.
    """
    return BusClosedError(
        f"the bus has not started: {doing} inside `async with bus:`, or in a FastAPI or "
        "Starlette app create the app with `lifespan=lifespan(bus)` (from "
        "asyncbus.integrations.starlette) so that it runs the bus"
    )


class HandlerError(AsyncbusError):
    """A request's route failed: the handler failed after its retries, or was dead-lettered.

    :ivar envelope: the envelope that failed.
    :ivar stage: the name of the stage where it failed, ``None`` when it reached none.
    :ivar attempts: how many times the handler was tried.
    """

    def __init__(
        self, message: str, *, envelope: Envelope, stage: str | None, attempts: int
    ) -> None:
        super().__init__(message)
        self.envelope = envelope
        self.stage = stage
        self.attempts = attempts


class HandlerTimeout(AsyncbusError, TimeoutError):
    """The handler ran longer than its stage's ``timeout``; dead-lettered as ``timeout``.

    Raised by the ``timeout`` middleware inside ``retry``, so a timed-out attempt is
    retried like any other failure.
    """


class Reject(AsyncbusError):
    """Raised by a handler to dead-letter the envelope at once, without retrying."""

    def __init__(self, reason: str = "rejected") -> None:
        super().__init__(reason)
        self.reason = reason


class BatchError(AsyncbusError):
    """Raised by a batch handler: only the envelopes at these positions failed.

    The others of the batch are acked, with no result: one of them that goes on along
    a routing slip or to a requester needs a result, so it is dead-lettered
    ``handler_failed`` at once (a ``TypeError`` saying so), never sent on as ``None``;
    on such routes return a list of results instead. Each failed envelope is retried
    and dead-lettered with its own exception (a :class:`Reject` dead-letters it at once).

    :ivar failures: position in the list the handler was given -> the exception for
        the envelope at that position.
    """

    def __init__(self, failures: Mapping[int, BaseException]) -> None:
        self.failures: dict[int, BaseException] = dict(failures)
        shown = ", ".join(
            f"{position}: {type(error).__name__}"
            for position, error in sorted(self.failures.items(), key=lambda item: repr(item[0]))[:5]
        )
        more = f" and {len(self.failures) - 5} more" if len(self.failures) > 5 else ""
        super().__init__(f"{len(self.failures)} envelope(s) of the batch failed ({shown}{more})")


class SerializationError(AsyncbusError):
    """A payload could not be encoded or decoded."""


class EncodeError(SerializationError):
    """A payload could not be encoded for the wire."""


class DecodeError(SerializationError):
    """A payload could not be decoded into what the handler asked for."""


class TransportError(AsyncbusError):
    """A transport failed to talk to its broker."""


class ConnectError(TransportError):
    """A transport could not connect to its broker."""
