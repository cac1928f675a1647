"""Orders on PostgreSQL alone: an order and its message commit together, and the stock
is taken exactly once per order.

* The bus's broker is the database (``PostgresTransport``): messages are rows in the
  schema ``{ORDERS_SCHEMA}_bus``, made when the app starts.
* ``POST /orders`` inserts the order and publishes ``orders.created`` through the same
  connection, in one transaction (``bus.publish(..., connection=conn)``): both or
  neither. The order's product is checked at commit (a deferred foreign key), after the
  publish, so an order for an unknown product rolls back with its message: a 422, no
  order, nothing published.
* The ``stock`` group takes the stock through ``current_connection()``, inside
  ``PostgresInbox``'s transaction, which also records the envelope as handled: a copy
  delivered again (a redelivery after a crash, a publish sent twice) is skipped.

Run it (needs ``pip install 'asyncbus[postgres,starlette]' fastapi uvicorn`` and a
PostgreSQL server; ``ORDERS_DSN`` defaults to the local one, ``ORDERS_SCHEMA`` to
``shop``, for the schemas ``shop``, ``shop_bus`` and ``shop_inbox``):

    uvicorn --app-dir examples outbox_orders:app

then ``curl -X POST localhost:8000/orders -H 'content-type: application/json'
-d '{"product": "book", "quantity": 2}'`` and ``curl localhost:8000/stock``.
"""

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import asyncpg
from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, Field

from asyncbus import Bus
from asyncbus.integrations.starlette import get_bus, lifespan
from asyncbus.transports.postgres import PostgresInbox, PostgresTransport, current_connection

DSN = os.environ.get("ORDERS_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = os.environ.get("ORDERS_SCHEMA", "shop")  # the app's tables

#: The app's own tables; the order's product is checked when its transaction commits.
TABLES = f"""
CREATE SCHEMA IF NOT EXISTS {SCHEMA};
CREATE TABLE IF NOT EXISTS {SCHEMA}.products (name text PRIMARY KEY, stock integer NOT NULL);
CREATE TABLE IF NOT EXISTS {SCHEMA}.orders (
    id bigserial PRIMARY KEY,
    product text NOT NULL REFERENCES {SCHEMA}.products DEFERRABLE INITIALLY DEFERRED,
    quantity integer NOT NULL
);
INSERT INTO {SCHEMA}.products VALUES ('book', 10), ('pen', 100) ON CONFLICT DO NOTHING;
"""


class Order(BaseModel):
    """The body of ``POST /orders``."""

    product: str
    quantity: int = Field(gt=0)


class OrderCreated(BaseModel):
    """The payload of ``orders.created``."""

    id: int
    product: str
    quantity: int


# The transport and the inbox each make their tables in a schema of their own.
bus = Bus(PostgresTransport(DSN, schema=f"{SCHEMA}_bus"), name="orders")
inbox = PostgresInbox(DSN, schema=f"{SCHEMA}_inbox")


@asynccontextmanager
async def run(app: FastAPI) -> AsyncIterator[None]:
    """Make the tables, open a pool for the requests, and run the bus while the app runs."""
    async with asyncpg.create_pool(DSN) as pool:
        await pool.execute(TABLES)
        app.state.pool = pool
        async with lifespan(bus)(app):
            yield


app = FastAPI(title="orders", lifespan=run)


@bus.subscribe("orders.created", group="stock", middleware=[inbox])
async def take_stock(order: OrderCreated) -> None:
    """Group "stock": commits with the inbox's record of this envelope, so once per order."""
    await current_connection().execute(
        f"UPDATE {SCHEMA}.products SET stock = stock - $1 WHERE name = $2",
        order.quantity,
        order.product,
    )


@app.post("/orders", status_code=201)
async def create_order(
    order: Order, request: Request, bus: Annotated[Bus, Depends(get_bus)]
) -> dict:
    """Insert the order and publish ``orders.created``, in one transaction."""
    try:
        async with request.app.state.pool.acquire() as conn, conn.transaction():
            order_id = await conn.fetchval(
                f"INSERT INTO {SCHEMA}.orders (product, quantity) VALUES ($1, $2) RETURNING id",
                order.product,
                order.quantity,
            )
            created = OrderCreated(id=order_id, **order.model_dump())
            receipt = await bus.publish("orders.created", created, connection=conn)
    except asyncpg.ForeignKeyViolationError:  # raised at commit: the message is gone too
        raise HTTPException(422, f"no product {order.product!r}") from None
    return {"id": order_id, "message": receipt.id}


@app.get("/stock")
async def stock(request: Request) -> dict[str, int]:
    """What is left of each product."""
    rows = await request.app.state.pool.fetch(
        f"SELECT name, stock FROM {SCHEMA}.products ORDER BY name"
    )
    return {row["name"]: row["stock"] for row in rows}
