"""Transports: where envelopes wait between publish and handle.

``MemoryTransport`` (the default) lives in this process; ``RedisTransport``,
``NatsTransport`` and ``RabbitTransport`` keep envelopes in a real broker. Broker
transports are imported lazily: ``from asyncbus.transports import RedisTransport``
imports the module (not its client library) only when asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._codec import Codec as Codec
from ._codec import JsonCodec as JsonCodec
from ._codec import MsgspecCodec as MsgspecCodec
from ._codec import default_codec as default_codec
from .base import Capabilities as Capabilities
from .base import Delivery as Delivery
from .base import DetailedDelivery as DetailedDelivery
from .base import Transport as Transport
from .memory import MemoryTransport as MemoryTransport

if TYPE_CHECKING:
    from .nats import NatsTransport as NatsTransport
    from .rabbit import RabbitTransport as RabbitTransport
    from .redis import RedisTransport as RedisTransport

__all__ = [
    "Capabilities",
    "Codec",
    "Delivery",
    "DetailedDelivery",
    "JsonCodec",
    "MemoryTransport",
    "MsgspecCodec",
    "NatsTransport",
    "RabbitTransport",
    "RedisTransport",
    "Transport",
    "default_codec",
]

_LAZY = {"RedisTransport": ".redis", "NatsTransport": ".nats", "RabbitTransport": ".rabbit"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
