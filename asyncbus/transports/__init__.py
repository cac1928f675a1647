"""Transports: where envelopes wait between publish and handle.

The contract is in :mod:`.base`: the core every transport implements
(:class:`Transport`, :class:`Delivery`) and the optional protocols a broker
implements when it can (:class:`DeadLetterStore`, :class:`RoutedPublisher`, ...).

``MemoryTransport`` (the default) lives in this process; ``RedisTransport``,
``NatsTransport`` and ``RabbitTransport`` keep envelopes in a real broker. Broker
transports are imported lazily: ``from asyncbus.transports import RedisTransport``
imports the module (not its client library) only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._codec import WIRE_FORMAT_VERSION as WIRE_FORMAT_VERSION
from ._codec import Codec as Codec
from ._codec import JsonCodec as JsonCodec
from ._codec import MsgspecCodec as MsgspecCodec
from ._codec import default_codec as default_codec
from ._raw_codecs import BytesCodec as BytesCodec
from ._raw_codecs import TextCodec as TextCodec
from ._registry import lazy_classes
from .base import AcksWrittenBehind as AcksWrittenBehind
from .base import BacklogReader as BacklogReader
from .base import BaseDelivery as BaseDelivery
from .base import Capabilities as Capabilities
from .base import DeadLetterChange as DeadLetterChange
from .base import DeadLetterStore as DeadLetterStore
from .base import DedupStoreProvider as DedupStoreProvider
from .base import Delivery as Delivery
from .base import GroupAdmin as GroupAdmin
from .base import GroupInfo as GroupInfo
from .base import GroupPublisher as GroupPublisher
from .base import KeepAlive as KeepAlive
from .base import LeaseStoreProvider as LeaseStoreProvider
from .base import PartitionLeasesProvider as PartitionLeasesProvider
from .base import RateStoreProvider as RateStoreProvider
from .base import RoutedPublisher as RoutedPublisher
from .base import SharedDeadLetters as SharedDeadLetters
from .base import SubscriptionControl as SubscriptionControl
from .base import TickClaimsProvider as TickClaimsProvider
from .base import TopicLimits as TopicLimits
from .base import Transport as Transport
from .base import TransportSettings as TransportSettings
from .memory import MemoryTransport as MemoryTransport

if TYPE_CHECKING:
    from .nats import NatsTransport as NatsTransport
    from .rabbit import RabbitTransport as RabbitTransport
    from .redis import RedisTransport as RedisTransport

__all__ = [
    "WIRE_FORMAT_VERSION",
    "AcksWrittenBehind",
    "BacklogReader",
    "BaseDelivery",
    "BytesCodec",
    "Capabilities",
    "Codec",
    "DeadLetterChange",
    "DeadLetterStore",
    "DedupStoreProvider",
    "Delivery",
    "GroupAdmin",
    "GroupInfo",
    "GroupPublisher",
    "JsonCodec",
    "KeepAlive",
    "LeaseStoreProvider",
    "MemoryTransport",
    "MsgspecCodec",
    "NatsTransport",
    "PartitionLeasesProvider",
    "RabbitTransport",
    "RateStoreProvider",
    "RedisTransport",
    "RoutedPublisher",
    "SharedDeadLetters",
    "SubscriptionControl",
    "TextCodec",
    "TickClaimsProvider",
    "TopicLimits",
    "Transport",
    "TransportSettings",
    "default_codec",
]

_LAZY = lazy_classes()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
