"""A malformed reply in a reply inbox never crashes a bus or hangs its caller.

Over a broker, a request's reply comes back through the requesting process's inbox
topic, which any client can write to. Whatever arrives there (a payload that is no
reply, a reply with fields of the wrong type, a body that does not decode), the
request it answers fails at once with a :class:`HandlerError` saying so, and the bus
goes on serving requests. The same holds for the inbox where NATS publishes wait for
JetStream's acks: an answer that is no ack fails that publish, never hangs it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, Envelope, HandlerError, TransportError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


MALFORMED: list[Any] = [
    ["a", "list"],
    "a string",
    None,
    {"neither": "result nor error"},
    {"error": "boom", "attempts": "many", "stage": ["not", "a", "name"]},
    {"error": "boom", "attempts": -1},
]


async def _write_undecodable(kind: str, url: str, prefix: str, topic: str) -> None:
    """A reply whose fields are fine and whose body is not JSON, written by a raw client."""
    meta = f'{{"id":"{uuid.uuid4().hex}","topic":"{topic}","timestamp":{time.time()}}}'
    body = b"\xff\xfe not json"
    if kind == "redis":
        import redis.asyncio as aioredis

        from asyncbus.transports.redis import RedisTransport

        group = topic.rpartition(".")[0]
        stream = RedisTransport(url, prefix=prefix).stream_key(f"{group}.*", group)
        client = aioredis.Redis.from_url(url)
        try:
            await client.xadd(stream, {"meta": meta, "body": body})
        finally:
            await client.aclose()
    elif kind == "nats":
        import nats

        from asyncbus.transports.nats import HEADER_META

        nc = await nats.connect(url, allow_reconnect=False)
        try:
            await nc.jetstream().publish(f"{prefix}.{topic}", body, headers={HEADER_META: meta})
        finally:
            await nc.close()
    elif kind == "postgres":
        import asyncpg

        from asyncbus.transports.postgres import PostgresTransport

        schema = prefix.replace("-", "_")
        # The transport's own publish statement, with rows written by this raw client.
        statement = PostgresTransport(url, schema=schema).sql.publish
        connection = await asyncpg.connect(url)
        try:
            row_id = json.loads(meta)["id"]
            await connection.fetch(statement, topic, [row_id], [meta.encode()], [body], [1])
        finally:
            await connection.close()
    else:
        import aiormq
        from pamqp.commands import Basic

        from asyncbus.transports.rabbit import META_HEADER

        connection = await aiormq.connect(url)
        try:
            channel = await connection.channel()
            await channel.basic_publish(
                body,
                exchange=prefix,
                routing_key=topic,
                properties=Basic.Properties(headers={META_HEADER: meta}),
            )
        finally:
            await connection.close()


async def test_a_malformed_reply_fails_its_request_and_the_bus_goes_on(
    kind: str, url: str, unique_prefix: str
) -> None:
    requester = Bus(transport=make_transport(kind, url, unique_prefix))
    responder = Bus(transport=make_transport(kind, url, unique_prefix))
    asked: list[tuple[str, anyio.Event]] = []
    answering = anyio.Event()

    @responder.subscribe("ask", group="r")
    async def answer(envelope: Envelope) -> str:
        if envelope.payload == "honest":
            return "an answer"
        gate = anyio.Event()
        assert envelope.reply_to is not None
        asked.append((envelope.reply_to, gate))
        answering.set()
        await gate.wait()  # the real reply comes after the malformed one, too late
        return "late"

    async def malformed_request(write: Any) -> HandlerError:
        nonlocal answering
        answering = anyio.Event()
        failure: list[HandlerError] = []

        async def ask() -> None:
            with pytest.raises(HandlerError) as raised:
                await requester.request("ask", "trick", timeout=30)
            failure.append(raised.value)

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(ask)
            await answering.wait()
            reply_to, gate = asked[-1]
            await write(reply_to)
        gate.set()
        return failure[0]

    with anyio.fail_after(50):
        async with responder, requester:
            for body in MALFORMED:

                async def publish(reply_to: str, body: Any = body) -> None:
                    await responder.publish(reply_to, body)

                error = await malformed_request(publish)
                if isinstance(body, dict) and "error" in body:
                    assert (error.stage, error.attempts) == (None, 0)
                    assert "boom" in str(error)
                else:
                    assert "malformed" in str(error), error

            async def undecodable(reply_to: str) -> None:
                await _write_undecodable(kind, url, unique_prefix, reply_to)

            error = await malformed_request(undecodable)
            assert "could not be read" in str(error), error
            # The bus still serves requests.
            assert await requester.request("ask", "honest", timeout=20) == "an answer"


async def test_nats_an_answer_that_is_no_ack_fails_the_publish_waiting_for_it(
    nats_url: str, nats_prefix: str
) -> None:
    import asyncio

    import nats

    from asyncbus.transports.nats import NatsTransport

    answers = [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"error": "not an object"}',
        b"[1, 2]",
        b"{}",
        b'{"stream": 5, "seq": 1}',
        b"\xff\xfe",
    ]
    async with NatsTransport(nats_url, prefix=nats_prefix) as transport:
        publisher = transport._connection.publishing()
        nc = await nats.connect(nats_url, allow_reconnect=False)
        try:
            for n, answer in enumerate(answers):
                # A publish waiting for its ack, as one does between send and answer.
                token = f"forged{n}"
                waiting = asyncio.get_running_loop().create_future()
                publisher._waiting[token] = (waiting, time.monotonic() + 30)
                await nc.publish(publisher._prefix + token, answer)
                await nc.flush()
                with anyio.fail_after(10), pytest.raises(TransportError, match="unreadable ack"):
                    await waiting
            # Publishing goes on as usual.
            await transport.publish("after", [Envelope(topic="after", payload=1)])
        finally:
            await nc.close()
