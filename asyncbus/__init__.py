"""asyncbus: an asyncio-native message bus of SEDA stages on bounded anyio streams.

Import everything from here; the modules behind it are private.
"""

from __future__ import annotations

from . import middleware as _middleware_package  # noqa: F401 - bind the subpackage first
from ._bus import DEADLETTER_TOPIC as DEADLETTER_TOPIC
from ._bus import Bus as Bus
from ._dead_letters import DeadLetter as DeadLetter
from ._dead_letters import DeadLetterQueue as DeadLetterQueue
from ._dead_letters import DeadLetterReason as DeadLetterReason
from ._envelope import HEADER_KEY as HEADER_KEY
from ._envelope import HEADER_REPLAYED as HEADER_REPLAYED
from ._envelope import Envelope as Envelope
from ._envelope import Receipt as Receipt
from ._exceptions import AsyncbusError as AsyncbusError
from ._exceptions import BusClosedError as BusClosedError
from ._exceptions import ConfigurationError as ConfigurationError
from ._exceptions import ConnectError as ConnectError
from ._exceptions import DecodeError as DecodeError
from ._exceptions import EncodeError as EncodeError
from ._exceptions import HandlerError as HandlerError
from ._exceptions import PublishTimeout as PublishTimeout
from ._exceptions import Reject as Reject
from ._exceptions import SerializationError as SerializationError
from ._exceptions import TransportError as TransportError
from ._runtime import FREE_THREADED as FREE_THREADED
from ._runtime import run as run
from ._stage import Backpressure as Backpressure
from ._stats import BusStatistics as BusStatistics
from ._stats import ShutdownReport as ShutdownReport
from ._stats import StageStatistics as StageStatistics
from ._subscription import Subscription as Subscription
from ._types import Handler as Handler
from ._types import Middleware as Middleware
from ._types import middleware as middleware
from .middleware.retry import Retry as Retry

__version__ = "0.1.0"

__all__ = [
    "DEADLETTER_TOPIC",
    "FREE_THREADED",
    "HEADER_KEY",
    "HEADER_REPLAYED",
    "AsyncbusError",
    "Backpressure",
    "Bus",
    "BusClosedError",
    "BusStatistics",
    "ConfigurationError",
    "ConnectError",
    "DeadLetter",
    "DeadLetterQueue",
    "DeadLetterReason",
    "DecodeError",
    "EncodeError",
    "Envelope",
    "Handler",
    "HandlerError",
    "Middleware",
    "PublishTimeout",
    "Receipt",
    "Reject",
    "Retry",
    "SerializationError",
    "ShutdownReport",
    "StageStatistics",
    "Subscription",
    "TransportError",
    "middleware",
    "run",
]
