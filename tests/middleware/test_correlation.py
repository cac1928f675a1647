"""Correlation: every envelope has a correlation_id, carried along everything it causes."""

from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, HandlerError, Retry

pytestmark = pytest.mark.anyio


async def test_envelope_without_correlation_uses_its_own_id() -> None:
    seen: list[Envelope] = []

    async def capture(env: Envelope) -> None:
        seen.append(env)

    bus = Bus()
    bus.subscribe("t", capture, group="g")
    with anyio.fail_after(5):
        async with bus:
            first = await bus.publish("t", 1)
            second = await bus.publish("t", 2)
            await bus.drain()

    assert [env.id for env in seen] == [first.id, second.id]
    assert first.id != second.id
    for env in seen:
        assert env.correlation_id == env.id


async def test_correlation_id_is_carried_through_slip_hops() -> None:
    seen: list[Envelope] = []

    async def capture(env: Envelope) -> Any:
        seen.append(env)
        return env.payload

    bus = Bus()
    for topic in ("a", "b", "c"):
        bus.subscribe(topic, capture, group=topic)
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("a", 1, slip=["b", "c"])
            await bus.drain()

    assert [env.topic for env in seen] == ["a", "b", "c"]
    assert [env.correlation_id for env in seen] == [receipt.id] * 3
    assert len({env.id for env in seen}) == 3


async def test_correlation_id_is_kept_across_retries() -> None:
    seen: list[Envelope] = []

    async def flaky(env: Envelope) -> None:
        seen.append(env)
        if env.attempt < 3:
            raise RuntimeError("again")

    bus = Bus()
    bus.subscribe("t", flaky, group="g", retry=Retry(max_attempts=3, backoff=0.01))
    with anyio.fail_after(5):
        async with bus:
            receipt = await bus.publish("t", 1)
            await bus.drain()

    assert [env.attempt for env in seen] == [1, 2, 3]
    assert [env.correlation_id for env in seen] == [receipt.id] * 3


async def test_correlation_id_is_carried_through_requests() -> None:
    seen: list[Envelope] = []

    async def capture(env: Envelope) -> Any:
        seen.append(env)
        return env.payload

    bus = Bus()
    bus.subscribe("a", capture, group="a")
    bus.subscribe("b", capture, group="b")
    with anyio.fail_after(5):
        async with bus:
            assert await bus.request("a", 5, slip=["b"], timeout=5) == 5
            await bus.drain()

    first, second = seen
    assert first.correlation_id == first.id
    assert second.correlation_id == first.id
    assert second.causation_id == first.id


async def test_correlation_id_is_kept_on_dead_letters() -> None:
    async def forward(payload: Any) -> Any:
        return payload

    async def broken(payload: Any) -> None:
        raise RuntimeError("broken")

    request_envs: list[Envelope] = []

    async def capture_request(env: Envelope) -> None:
        request_envs.append(env)
        raise RuntimeError("broken too")

    bus = Bus()
    bus.subscribe("fwd", forward, group="g")
    bus.subscribe("broken", broken, group="g")
    bus.subscribe("req", capture_request, group="g")
    with anyio.fail_after(5):
        async with bus:
            failed = await bus.publish("broken", 1)
            hopped = await bus.publish("fwd", 2, slip=["nowhere"])
            with pytest.raises(HandlerError) as caught:
                await bus.request("req", 3, timeout=30)
            await bus.drain()

            (failed_letter,) = bus.dead_letters.list(topic="broken")
            assert failed_letter.reason == DeadLetterReason.HANDLER_FAILED
            assert failed_letter.envelope.correlation_id == failed.id

            (hop_letter,) = bus.dead_letters.list(topic="nowhere")
            assert hop_letter.reason == DeadLetterReason.NO_SUBSCRIBERS
            assert hop_letter.envelope.correlation_id == hopped.id

            (request_env,) = request_envs
            (request_letter,) = bus.dead_letters.list(topic="req")
            assert request_letter.envelope.correlation_id == request_env.id
            assert caught.value.envelope.correlation_id == request_env.id
