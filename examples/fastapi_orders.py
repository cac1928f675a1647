"""An order service: FastAPI publishes on POST /orders, the bus does the rest.

* The bus runs for the life of the app: ``lifespan(bus)`` enters ``async with bus:``
  at startup and drains it at shutdown.
* ``POST /orders`` validates the order and publishes it; handlers in two groups (the
  mailer and the warehouse) each get every order, decoded into the ``Order`` model.
* ``/admin`` is asyncbus's admin app: a live dashboard at ``/admin/``, JSON at
  ``/admin/stats`` and ``/admin/dead-letters``, with replay and purge. It wants
  ``Authorization: Bearer <token>``; in a real service also mount it behind your own
  authentication.

Run it (needs ``pip install 'asyncbus[starlette]' fastapi uvicorn``):

    ADMIN_TOKEN=secret python examples/fastapi_orders.py
    # or: ADMIN_TOKEN=secret uvicorn --app-dir examples fastapi_orders:app

then ``curl -X POST localhost:8000/orders -H 'content-type: application/json'
-d '{"id": 1, "item": "book", "quantity": 2}'`` and open
http://127.0.0.1:8000/admin/?token=secret to watch.
"""

import os
import secrets
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI
from pydantic import BaseModel, Field

from asyncbus import Bus, Reject
from asyncbus.integrations.starlette import admin_app, get_bus, lifespan

ADMIN_TOKEN = os.environ.get("ADMIN_TOKEN") or secrets.token_urlsafe(16)


class Order(BaseModel):
    id: int
    item: str
    quantity: int = Field(gt=0)


bus = Bus(name="orders-service")
app = FastAPI(title="orders", lifespan=lifespan(bus))
app.mount("/admin", admin_app(bus, token=ADMIN_TOKEN))

stock = {"book": 10, "pen": 100}


@bus.subscribe("orders.created", group="mailer")
async def send_confirmation(order: Order) -> None:
    """Group "mailer": every order, decoded into ``Order`` (the annotation asks for it)."""
    print(f"mailer: confirmation sent for order {order.id}", flush=True)


@bus.subscribe("orders.created", group="warehouse")
async def reserve_stock(order: Order) -> None:
    """Group "warehouse": every order too; an unknown item is dead-lettered at once."""
    if stock.get(order.item, 0) < order.quantity:
        raise Reject(f"not enough {order.item!r} in stock for order {order.id}")
    stock[order.item] -= order.quantity
    print(f"warehouse: reserved {order.quantity} x {order.item} for order {order.id}", flush=True)


@app.post("/orders", status_code=202)
async def create_order(order: Order, bus: Annotated[Bus, Depends(get_bus)]) -> dict:
    """Accept an order and publish it; the handlers run after the response is sent."""
    receipt = await bus.publish("orders.created", order.model_dump())
    return {"id": receipt.id, "stages": list(receipt.accepted)}


if __name__ == "__main__":
    port = int(os.environ.get("PORT", "8000"))
    print(f"admin dashboard: http://127.0.0.1:{port}/admin/?token={ADMIN_TOKEN}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port)
