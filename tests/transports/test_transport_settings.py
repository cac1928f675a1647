"""Broker transports check their settings where they are given: a number that cannot
work (NaN, an infinity, a negative or zero duration, a bool, a string, a number too
large for the broker) is a ``ConfigurationError`` from the constructor, naming it.

The constructors do not touch the broker; ``prefetch`` is checked by ``subscribe``
before anything is declared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from _brokers import (  # type: ignore[import-not-found]
    BROKERS,
    make_transport,  # type: ignore[import-not-found]
    names,
)

from asyncbus import ConfigurationError, ConnectError
from asyncbus.transports import Transport
from asyncbus.transports.nats import NatsTransport
from asyncbus.transports.rabbit import RabbitTransport
from asyncbus.transports.redis import RedisTransport

pytestmark = pytest.mark.timeout(10)

NAN = float("nan")
INF = float("inf")
#: Bad values for any duration (seconds).
BAD_SECONDS: list[Any] = [NAN, INF, -INF, -1, 0, 0.0, -0.5, True, False, "5", None, 10**400, 1e300]

SECONDS: dict[type[Transport], list[str]] = {
    RedisTransport: ["ack_timeout", "publish_timeout", "claim_interval"],
    NatsTransport: [
        "ack_timeout",
        "connect_timeout",
        "request_timeout",
        "publish_timeout",
        "dedup_window",
        "reconnect_wait",
        "max_age",
    ],
    RabbitTransport: ["ack_timeout", "publish_timeout", "connect_timeout", "max_backoff"],
}

CASES = [
    (transport, name, value)
    for transport, names in SECONDS.items()
    for name in names
    for value in BAD_SECONDS
    # max_age=None is "no age limit", publish_timeout=None on NATS is request_timeout.
    if not (value is None and (name == "max_age" or transport is NatsTransport))
]


@pytest.mark.parametrize(("transport", "name", "value"), CASES)
def test_a_duration_that_cannot_work_is_refused(
    transport: Callable[..., Transport], name: str, value: Any
) -> None:
    with pytest.raises(ConfigurationError, match=name):
        transport(**{name: value})


@pytest.mark.parametrize("transport", list(SECONDS))
@pytest.mark.parametrize("value", [0, -1, True, 1.5, 3.0, "3", NAN, INF, 10**9, 2**63])
def test_max_deliveries_must_be_a_sensible_int(
    transport: Callable[..., Transport], value: Any
) -> None:
    with pytest.raises(ConfigurationError, match="max_deliveries"):
        transport(max_deliveries=value)


@pytest.mark.parametrize("transport", [RedisTransport, RabbitTransport])
@pytest.mark.parametrize("value", [True, 0, -1, 2.5, "1024"])
def test_max_message_size_must_be_an_int_above_zero(
    transport: Callable[..., Transport], value: Any
) -> None:
    with pytest.raises(ConfigurationError, match="max_message_size"):
        transport(max_message_size=value)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, 200.0, NAN, INF, "200", 10**12])
def test_redis_block_ms_must_be_an_int_within_an_hour(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="block_ms"):
        RedisTransport(block_ms=value)


@pytest.mark.parametrize("transport", list(SECONDS))
@pytest.mark.parametrize("value", [1, "yes", None])
def test_keep_alive_must_be_a_bool(transport: Callable[..., Transport], value: Any) -> None:
    with pytest.raises(ConfigurationError, match="keep_alive"):
        transport(keep_alive=value)


@pytest.mark.parametrize("transport", list(SECONDS))
def test_sensible_settings_are_kept(transport: Callable[..., Transport]) -> None:
    made: Any = transport(ack_timeout=2, publish_timeout=1.5, max_deliveries=1_000_000)
    assert (made.ack_timeout, made.publish_timeout, made.max_deliveries) == (2.0, 1.5, 1_000_000)
    assert isinstance(made.ack_timeout, float)


@pytest.mark.anyio
@pytest.mark.backends("asyncio")
@pytest.mark.parametrize("value", [0, -1, True, 2.5, "8", NAN])
async def test_a_bad_prefetch_is_a_configuration_error(
    kind: str, url: str, unique_prefix: str, value: Any
) -> None:
    async with make_transport(kind, url, unique_prefix) as transport:
        with anyio.fail_after(10), pytest.raises(ConfigurationError, match="prefetch"):
            async with transport.subscribe("settings.check", group="g", prefetch=value):
                pass


# -- the URL and the client library, at construction ------------------------------------

BAD_URLS: dict[type[Transport], list[Any]] = {
    RedisTransport: [
        "127.0.0.1:6379",  # no scheme: redis-py raised its own ValueError at connect
        "localhost:6379/0",
        "app:s3cret@127.0.0.1:6379/0",
        "http://127.0.0.1:6379/0",
        "redis://127.0.0.1:port/0",
        "redis://127.0.0.1:70000/0",
        "redis://127.0.0.1:6379/0,127.0.0.1:6380",
        "",
        None,
        6379,
    ],
    NatsTransport: [
        "127.0.0.1:4222",
        "amqp://127.0.0.1:4222",
        "nats://127.0.0.1:42x2",
        "nats://app:s3cret@127.0.0.1:4222,nats://127.0.0.1:99999",
        " ",
        b"nats://127.0.0.1:4222",
    ],
    RabbitTransport: [
        "guest:guest@127.0.0.1:5672/",
        "redis://127.0.0.1:5672/",
        "amqp://guest:guest@127.0.0.1:-1/",
        "",
    ],
}
SCHEMES = {RedisTransport: "redis://", NatsTransport: "nats://", RabbitTransport: "amqp://"}


@pytest.mark.parametrize(
    ("transport", "url"), [(kind, url) for kind, urls in BAD_URLS.items() for url in urls]
)
def test_a_url_that_cannot_work_is_refused_when_the_transport_is_created(
    transport: type[Transport], url: Any
) -> None:
    with pytest.raises(ConfigurationError) as caught:
        transport(url)
    message = str(caught.value)
    assert message.startswith(f"{transport.__name__}: "), message
    assert SCHEMES[transport] in message  # what a URL looks like
    assert "s3cret" not in message  # credentials never shown


@pytest.mark.parametrize(
    ("transport", "url"),
    [
        (RedisTransport, "redis://127.0.0.1:6379/0"),
        (RedisTransport, "rediss://app:s3cret@cache.example:6380/2"),
        (RedisTransport, "unix:///run/redis.sock"),
        (RedisTransport, "REDIS://127.0.0.1"),
        (NatsTransport, "nats://127.0.0.1:4222"),
        (NatsTransport, "tls://a.example:4222,nats://b.example:4222"),
        (RabbitTransport, "amqp://guest:guest@127.0.0.1:5672/"),
        (RabbitTransport, "amqps://app:s3cret@rabbit.example/vhost?heartbeat=10"),
        # A scheme of no broker asyncbus knows: the client library judges it on connecting.
        (RedisTransport, "unused://"),
        (NatsTransport, "unused://"),
        (RabbitTransport, "unused://"),
    ],
)
def test_a_url_that_can_work_is_kept(transport: type[Transport], url: str) -> None:
    assert transport(url).url == url  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", names())
def test_a_missing_client_library_is_refused_when_the_transport_is_created(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, the transport was made and ``async with bus`` failed later (ConnectError)."""
    broker = BROKERS[kind]
    transport = broker.transport_class()
    extra, packages = broker.extra, broker.client_modules
    for package in packages:
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, package, None)  # as if it were not installed
            with pytest.raises(ImportError) as caught:
                transport()
        # An ImportError, as the integrations' extras; a ConfigurationError, as any
        # setting that cannot work; and the ConnectError connect raised for it before.
        assert isinstance(caught.value, ConfigurationError)
        assert isinstance(caught.value, ConnectError)
        assert str(caught.value) == (
            f"{transport.__name__} needs the '{extra}' extra: pip install 'asyncbus[{extra}]'"
        )


@pytest.mark.anyio
@pytest.mark.backends("asyncio")
async def test_a_url_redis_py_cannot_read_is_a_configuration_error_when_entered() -> None:
    """A scheme of no broker asyncbus knows is left to the client, which refuses it
    on connecting: a ConfigurationError, not redis-py's raw ValueError."""
    transport = RedisTransport("unused://app:s3cret@127.0.0.1:6379/0")
    with anyio.fail_after(10), pytest.raises(ConfigurationError) as caught:
        async with transport:
            pass
    assert "redis://" in str(caught.value) and "s3cret" not in str(caught.value)
