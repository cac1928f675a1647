"""What a foreign client does to a broker, for tests of what the bus makes of it."""

from __future__ import annotations


async def insert_row(
    url: str,
    prefix: str,
    pattern: str,
    group: str,
    envelope_id: str,
    meta: bytes,
    body: bytes,
    attempt: int = 1,
) -> None:
    """Insert one row for ``pattern@group`` into a ``PostgresTransport`` schema with plain
    asyncpg, and notify its consumers, in one transaction (as the guide documents it)."""
    import asyncpg

    schema = prefix.replace("-", "_")
    connection = await asyncpg.connect(url, timeout=5)
    try:
        async with connection.transaction():
            group_id = await connection.fetchval(
                f"SELECT id FROM {schema}.groups WHERE pattern = $1 AND grp = $2", pattern, group
            )
            await connection.execute(
                f"INSERT INTO {schema}.messages (group_id, envelope_id, meta, body, attempt) "
                "VALUES ($1, $2, $3, $4, $5)",
                group_id,
                envelope_id,
                meta,
                body,
                attempt,
            )
            await connection.execute("SELECT pg_notify($1, $2)", schema, str(group_id))
    finally:
        await connection.close()


async def publish_amqp(url: str, exchange_name: str, routing_key: str, message: object) -> None:
    """Publish one ``aio_pika.Message`` to ``exchange_name`` with a connection of its own."""
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(exchange_name, ensure=False)
        await exchange.publish(message, routing_key=routing_key)  # type: ignore[arg-type]
    finally:
        await connection.close()
