"""JetStreamPublisher against the local nats-server: acks, refusals, no stream, timeouts."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from asyncbus import TransportError
from asyncbus.transports._kit import TaskOwner
from asyncbus.transports._nats_publisher import JetStreamPublisher, NoStreamError

nats = pytest.importorskip("nats")

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def stream(nats_url: str) -> AsyncIterator[tuple[Any, str]]:
    """A connected client and the name of a fresh stream capturing ``{name}.>``."""
    from nats.js.api import StreamConfig

    name = f"PUBTEST_{secrets.token_hex(4).upper()}"
    nc = await nats.connect(nats_url, allow_reconnect=False, connect_timeout=2)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[f"{name.lower()}.>"]))
    try:
        yield nc, name
    finally:
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
            await nc.close()


@pytest.fixture
async def publisher(stream: tuple[Any, str]) -> AsyncIterator[JetStreamPublisher]:
    nc, _name = stream
    publisher = JetStreamPublisher(nc, timeout=0.5)
    tasks = TaskOwner("test")
    await tasks.open()
    await publisher.start(tasks)
    try:
        yield publisher
    finally:
        await publisher.stop()
        await tasks.aclose()


@pytest.mark.anyio
async def test_concurrent_publishes_are_each_stored_once(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, name = stream
    subject = f"{name.lower()}.items"

    async def send(index: int) -> None:
        await publisher.publish(subject, b"%d" % index, {"Nats-Msg-Id": f"m-{index}"})

    async with anyio.create_task_group() as task_group:
        for index in range(500):
            task_group.start_soon(send, index)
    info = await nc.jetstream().stream_info(name)
    assert info.state.messages == 500
    assert publisher._waiting == {}  # every future answered and forgotten


@pytest.mark.anyio
async def test_duplicate_id_is_acked_and_stored_once(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, name = stream
    subject = f"{name.lower()}.items"
    for _ in range(3):
        await publisher.publish(subject, b"same", {"Nats-Msg-Id": "one-id"})
    info = await nc.jetstream().stream_info(name)
    assert info.state.messages == 1


@pytest.mark.anyio
async def test_a_refusal_by_the_stream_is_a_transport_error(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, name = stream
    with pytest.raises(TransportError, match="JetStream refused the message"):
        await publisher.publish(
            f"{name.lower()}.items", b"x", {"Nats-Expected-Stream": "SOME_OTHER_STREAM"}
        )
    info = await nc.jetstream().stream_info(name)
    assert info.state.messages == 0


@pytest.mark.anyio
async def test_a_subject_no_stream_captures_is_a_transport_error(
    publisher: JetStreamPublisher,
) -> None:
    with pytest.raises(TransportError, match="no JetStream stream captures"):
        await publisher.publish(f"nostream_{secrets.token_hex(4)}.x", b"x", {})


@pytest.mark.anyio
async def test_a_publish_nobody_acks_times_out(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, _name = stream
    # A plain subscriber (no stream) takes the message and never answers.
    subject = f"silent_{secrets.token_hex(4)}.x"
    received: list[bytes] = []

    async def swallow(msg: Any) -> None:
        received.append(msg.data)

    subscription = await nc.subscribe(subject, cb=swallow)
    try:
        with anyio.fail_after(5):
            with pytest.raises(TimeoutError, match=r"no ack from JetStream within 0\.5 s"):
                await publisher.publish(subject, b"lost", {})
    finally:
        await subscription.unsubscribe()
    assert received == [b"lost"]
    assert publisher._waiting == {}


@pytest.mark.anyio
async def test_stop_fails_what_still_waits(stream: tuple[Any, str]) -> None:
    nc, _name = stream
    publisher = JetStreamPublisher(nc, timeout=30)
    tasks = TaskOwner("test")
    await tasks.open()
    await publisher.start(tasks)
    subject = f"silent_{secrets.token_hex(4)}.x"
    subscription = await nc.subscribe(subject, cb=_ignore)
    outcome: list[BaseException] = []

    async def send() -> None:
        try:
            await publisher.publish(subject, b"x", {})
        except TransportError as error:
            outcome.append(error)

    try:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(send)
            with anyio.fail_after(5):
                while not publisher._waiting:
                    await anyio.lowlevel.checkpoint()
            await publisher.stop()
    finally:
        await subscription.unsubscribe()
        await tasks.aclose()
    assert [str(error) for error in outcome] == ["the NATS connection closed before the ack"]


async def _ignore(msg: Any) -> None:
    return None


@pytest.mark.anyio
async def test_publish_many_returns_once_every_message_is_stored(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, name = stream
    messages = [(b"%d" % index, {"Nats-Msg-Id": f"m-{index}"}) for index in range(300)]
    await publisher.publish_many(f"{name.lower()}.items", messages)
    info = await nc.jetstream().stream_info(name)
    assert (info.state.messages, info.state.first_seq, info.state.last_seq) == (300, 1, 300)
    assert publisher._waiting == {}


@pytest.mark.anyio
async def test_publish_many_raises_the_first_refusal_and_stores_the_rest(
    stream: tuple[Any, str], publisher: JetStreamPublisher
) -> None:
    nc, name = stream
    refused = {"Nats-Msg-Id": "m-1", "Nats-Expected-Stream": "SOME_OTHER_STREAM"}
    messages = [(b"0", {"Nats-Msg-Id": "m-0"}), (b"1", refused), (b"2", {"Nats-Msg-Id": "m-2"})]
    with pytest.raises(TransportError, match="JetStream refused the message"):
        await publisher.publish_many(f"{name.lower()}.items", messages)
    info = await nc.jetstream().stream_info(name)
    assert info.state.messages == 2
    assert publisher._waiting == {}


@pytest.mark.anyio
async def test_publish_many_where_no_stream_captures_the_subject(
    publisher: JetStreamPublisher,
) -> None:
    with pytest.raises(NoStreamError):
        await publisher.publish_many(f"nostream_{secrets.token_hex(4)}.x", [(b"x", {}), (b"y", {})])
    assert publisher._waiting == {}
