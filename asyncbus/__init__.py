"""asyncbus: an asyncio-native message bus of SEDA stages on bounded anyio streams.

Import everything from here; the modules behind it are private.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import transports as _transports
from ._adaptive import Adaptive as Adaptive
from ._admission import Admission as Admission
from ._admission import Priority as Priority
from ._batch import Batch as Batch
from ._bus import DEADLETTER_TOPIC as DEADLETTER_TOPIC
from ._bus import Bus as Bus
from ._cluster import ClusterStatistics as ClusterStatistics
from ._cluster import ProcessStatistics as ProcessStatistics
from ._dead_letters import DeadLetter as DeadLetter
from ._dead_letters import DeadLetterQueue as DeadLetterQueue
from ._dead_letters import DeadLetterReason as DeadLetterReason
from ._envelope import HEADER_KEY as HEADER_KEY
from ._envelope import HEADER_PRIORITY as HEADER_PRIORITY
from ._envelope import HEADER_REPLAYED as HEADER_REPLAYED
from ._envelope import HEADER_WIRE as HEADER_WIRE
from ._envelope import Envelope as Envelope
from ._envelope import Receipt as Receipt
from ._exceptions import AsyncbusError as AsyncbusError
from ._exceptions import BatchError as BatchError
from ._exceptions import BusClosedError as BusClosedError
from ._exceptions import ConfigurationError as ConfigurationError
from ._exceptions import ConnectError as ConnectError
from ._exceptions import DecodeError as DecodeError
from ._exceptions import EncodeError as EncodeError
from ._exceptions import HandlerError as HandlerError
from ._exceptions import HandlerTimeout as HandlerTimeout
from ._exceptions import PublishTimeout as PublishTimeout
from ._exceptions import Reject as Reject
from ._exceptions import SerializationError as SerializationError
from ._exceptions import TransportError as TransportError
from ._groups import GroupInfo as GroupInfo
from ._groups import GroupListing as GroupListing
from ._runtime import FREE_THREADED as FREE_THREADED
from ._runtime import run as run
from ._stage import Backpressure as Backpressure
from ._stats import BusStatistics as BusStatistics
from ._stats import ScheduleStatistics as ScheduleStatistics
from ._stats import ShutdownReport as ShutdownReport
from ._stats import StageStatistics as StageStatistics
from ._subscription import Subscription as Subscription
from ._time.held import ScheduledEnvelope as ScheduledEnvelope
from ._time.periodic import Schedule as Schedule
from ._types import Handler as Handler
from ._types import Middleware as Middleware
from ._verdicts import DeadLetterNow as DeadLetterNow
from ._verdicts import Defer as Defer
from ._verdicts import RetryAfter as RetryAfter
from ._verdicts import Skip as Skip
from ._verdicts import Verdict as Verdict
from .middleware.rate_limit import RateLimit as RateLimit
from .middleware.retry import Retry as Retry
from .transports import Capabilities as Capabilities
from .transports import Codec as Codec
from .transports import Delivery as Delivery
from .transports import MemoryTransport as MemoryTransport
from .transports import Transport as Transport

if TYPE_CHECKING:
    from ._types import middleware as middleware
else:
    # The package of built-ins, callable as the ``@middleware`` decorator (see there).
    from . import middleware as middleware

if TYPE_CHECKING:
    from .transports.nats import NatsTransport as NatsTransport
    from .transports.rabbit import RabbitTransport as RabbitTransport
    from .transports.redis import RedisTransport as RedisTransport

__version__ = "0.1.0"

__all__ = [
    "DEADLETTER_TOPIC",
    "FREE_THREADED",
    "HEADER_KEY",
    "HEADER_PRIORITY",
    "HEADER_REPLAYED",
    "HEADER_WIRE",
    "Adaptive",
    "Admission",
    "AsyncbusError",
    "Backpressure",
    "Batch",
    "BatchError",
    "Bus",
    "BusClosedError",
    "BusStatistics",
    "Capabilities",
    "ClusterStatistics",
    "Codec",
    "ConfigurationError",
    "ConnectError",
    "DeadLetter",
    "DeadLetterNow",
    "DeadLetterQueue",
    "DeadLetterReason",
    "DecodeError",
    "Defer",
    "Delivery",
    "EncodeError",
    "Envelope",
    "GroupInfo",
    "GroupListing",
    "Handler",
    "HandlerError",
    "HandlerTimeout",
    "MemoryTransport",
    "Middleware",
    "NatsTransport",
    "Priority",
    "ProcessStatistics",
    "PublishTimeout",
    "RabbitTransport",
    "RateLimit",
    "Receipt",
    "RedisTransport",
    "Reject",
    "Retry",
    "RetryAfter",
    "Schedule",
    "ScheduleStatistics",
    "ScheduledEnvelope",
    "SerializationError",
    "ShutdownReport",
    "Skip",
    "StageStatistics",
    "Subscription",
    "Transport",
    "TransportError",
    "Verdict",
    "middleware",
    "run",
]

#: Broker transports, imported on first use (their modules import no client library
#: until they connect, but need not load with the bus at all).
_LAZY_TRANSPORTS = frozenset(
    {"NatsTransport", "PostgresTransport", "RabbitTransport", "RedisTransport"}
)


def __getattr__(name: str) -> Any:
    if name in _LAZY_TRANSPORTS:
        return getattr(_transports, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_TRANSPORTS})
