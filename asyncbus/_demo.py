"""``python -m asyncbus demo``: an orders pipeline that shows what the bus does."""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import anyio
from anyio.abc import TaskGroup

from ._bus import Bus
from ._envelope import Envelope
from ._stage import Backpressure
from ._stats import BusStatistics
from .middleware.retry import Retry

__all__ = ["DemoError", "format_statistics", "run_demo"]


class DemoError(Exception):
    """The demo cannot run as asked (a missing extra, a port in use): one line says why."""


#: Orders a second that keep the served demo's dashboard live once the batch is done.
TRICKLE_PER_SECOND = 5


def _listen(port: int) -> socket.socket:
    """The dashboard's listening socket on 127.0.0.1, bound before anything starts."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as error:
        raise DemoError(
            f"demo --serve needs {error.name or 'starlette'}: "
            "pip install 'asyncbus[starlette]' uvicorn"
        ) from None
    from ._cli.admin import listening_socket

    try:
        listener = listening_socket("127.0.0.1", port)
    except OSError as error:
        raise DemoError(
            f"demo --serve cannot listen on 127.0.0.1:{port}: {error.strerror or error}"
        ) from None
    listener.setblocking(False)
    return listener


async def _serve_dashboard(
    bus: Bus, listener: socket.socket, task_group: TaskGroup, out: TextIO
) -> anyio.Event:
    """Serve ``admin_app(bus)`` on ``listener`` with uvicorn; the event fires when it stops."""
    from ._cli.admin import start_uvicorn
    from .integrations.starlette import admin_app

    # Ctrl-C is ours: it stops the server, then the demo finishes and reports.
    server, stopped = start_uvicorn(admin_app(bus), listener, task_group)

    async def stop_on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                server.should_exit = True
                return

    task_group.start_soon(stop_on_signal)
    while not server.started and not stopped.is_set():
        await anyio.sleep(0.01)
    port = listener.getsockname()[1]
    out.write(f"dashboard: http://127.0.0.1:{port}/  (Ctrl-C stops it)\n")
    out.flush()
    return stopped


_COLUMNS = (
    ("stage", "name"),
    ("published", "published"),
    ("acked", "acked"),
    ("retried", "retried"),
    ("dead", "dead_lettered"),
    ("dropped", "dropped"),
    ("depth", "depth"),
    ("in flight", "in_flight"),
    ("p50 ms", "latency_p50"),
    ("p99 ms", "latency_p99"),
)


def format_statistics(statistics: BusStatistics) -> str:
    """Render a statistics snapshot as a plain-text table, one row per stage."""
    rows: list[list[str]] = [[title for title, _ in _COLUMNS]]
    for stage in statistics.stages:
        row = []
        for _, field in _COLUMNS:
            value = getattr(stage, field)
            row.append(f"{value * 1000:.2f}" if isinstance(value, float) else str(value))
        rows.append(row)
    widths = [max(len(row[index]) for row in rows) for index in range(len(_COLUMNS))]
    lines = []
    for number, row in enumerate(rows):
        cells = [
            cell.ljust(width) if index == 0 else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def build_demo_bus(orders: int) -> tuple[Bus, dict[str, int]]:
    """The demo's bus: fan-out, a competing work queue, a slip and a flaky stage."""
    bus = Bus(name="demo", dead_letter_ttl=3600)
    seen = {"audited": 0, "mailed": 0, "packed": 0, "shipped": 0}

    @bus.subscribe("orders.created", group="audit")
    async def audit(order: dict[str, Any]) -> None:
        seen["audited"] += 1

    # Two handlers in one group compete for the work: each order is mailed once.
    @bus.subscribe("orders.created", group="mailer", concurrency=4, capacity=64)
    async def mail_primary(order: dict[str, Any]) -> None:
        await anyio.sleep(random.uniform(0, 0.002))  # the mail server is slowish
        seen["mailed"] += 1

    @bus.subscribe("orders.created", group="mailer", concurrency=2, capacity=64)
    async def mail_fallback(order: dict[str, Any]) -> None:
        await anyio.sleep(random.uniform(0, 0.004))
        seen["mailed"] += 1

    # A payment provider that fails for some cards: retried, then dead-lettered.
    @bus.subscribe(
        "orders.created",
        group="payments",
        concurrency=4,
        retry=Retry(max_attempts=3, backoff=0.01, jitter=False),
    )
    async def charge(env: Envelope) -> dict[str, Any]:
        order: dict[str, Any] = env.payload
        if order["card"].endswith("13"):
            raise RuntimeError(f"card {order['card']} declined")
        return order

    # A routing slip through a CPU-ish sync stage (runs on the worker pool).
    @bus.subscribe("warehouse.pack", group="packers", concurrency=2)
    def pack(order: dict[str, Any]) -> dict[str, Any]:
        seen["packed"] += 1
        return {**order, "parcel": f"P{order['id']:05d}"}

    @bus.subscribe("warehouse.ship", group="shipping", backpressure=Backpressure.BLOCK)
    async def ship(order: dict[str, Any]) -> None:
        seen["shipped"] += 1

    del audit, mail_primary, mail_fallback, charge, pack, ship
    seen["orders"] = orders
    return bus, seen


def _order(number: int) -> dict[str, Any]:
    # One card in a hundred ends in 13 and is declined by the payment stage.
    return {"id": number, "card": f"4111-{number % 100:02d}", "total": number % 97}


def _progress(bus: Bus, published: int, of: str) -> str:
    stats = bus.statistics()
    return (
        f"\rpublished {published}{of} orders | acked {stats.acked} | "
        f"dead letters {len(bus.dead_letters)} | in flight {stats.in_flight}   "
    )


async def run_demo(
    orders: int = 2000, out: TextIO = sys.stdout, *, serve: bool = False, port: int = 8000
) -> BusStatistics:
    """Run the demo pipeline, printing progress and the statistics table; return the stats.

    :param serve: also serve the admin dashboard on ``127.0.0.1:port`` while the orders
        flow (a few hundred a second, so a person can watch); after them, keep a gentle
        stream of orders flowing so the page stays live, until interrupted (Ctrl-C);
        then drain and print the table.
    :raises DemoError: when ``serve`` cannot work (a missing extra, the port in use).
    """
    listener = _listen(port) if serve else None
    try:
        with _collect_log() as records:
            statistics = await _run_pipeline(orders, out, listener)
    finally:
        if listener is not None:
            listener.close()
    out.write(f"the bus logged {len(records)} record(s) (logger 'asyncbus', WARNING and up):\n")
    for record in records:
        out.write(f"  {record.levelname} {record.name}: {record.getMessage()}\n")
    return statistics


class _Kept(logging.Handler):
    """A handler that keeps what it is given."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _collect_log() -> Iterator[list[logging.LogRecord]]:
    """Keep the bus's log records for the end of the demo (not amid its progress line)."""
    handler = _Kept(logging.WARNING)
    records = handler.records
    logger = logging.getLogger("asyncbus")
    propagate, logger.propagate = logger.propagate, False
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


async def _run_pipeline(orders: int, out: TextIO, listener: socket.socket | None) -> BusStatistics:
    bus, seen = build_demo_bus(orders)
    async with bus:
        async with anyio.create_task_group() as task_group:
            dashboard = None
            if listener is not None:
                dashboard = await _serve_dashboard(bus, listener, task_group, out)
            for number in range(1, orders + 1):
                order = _order(number)
                await bus.publish("orders.created", order)
                await bus.publish("warehouse.pack", order, slip=["warehouse.ship"])
                if dashboard is not None:
                    await anyio.sleep(0.003)
                if number % 200 == 0 or number == orders:
                    out.write(_progress(bus, number, f"/{orders}"))
                    out.flush()
            if dashboard is not None:
                out.write(
                    f"\nthe dashboard stays live with {TRICKLE_PER_SECOND} more orders a second; "
                    "press Ctrl-C to stop\n"
                )
                out.flush()
                number = orders
                while not dashboard.is_set():
                    number += 1
                    order = _order(number)
                    await bus.publish("orders.created", order)
                    await bus.publish("warehouse.pack", order, slip=["warehouse.ship"])
                    if number % TRICKLE_PER_SECOND == 0:
                        out.write(_progress(bus, number, ""))
                        out.flush()
                    with anyio.move_on_after(1 / TRICKLE_PER_SECOND):
                        await dashboard.wait()
                seen["orders"] = number
                task_group.cancel_scope.cancel()  # the signal watcher, if still waiting
        # The server and the signal watcher are stopped: drain with nothing cancelled.
        await bus.drain(timeout=60)
        out.write("\n\n")
        statistics = bus.statistics()
        out.write(format_statistics(statistics) + "\n\n")
        by_reason: dict[str, int] = {}
        for entry in bus.dead_letters.list():
            by_reason[entry.reason.value] = by_reason.get(entry.reason.value, 0) + 1
        out.write(
            f"audited {seen['audited']}, mailed {seen['mailed']} (each once, by competing "
            f"consumers), packed {seen['packed']}, shipped {seen['shipped']}\n"
        )
        out.write(f"dead letters by reason: {by_reason}\n")
        first = bus.dead_letters.list()[:1]
        if first:
            out.write(
                f"first dead letter: {first[0].error.splitlines()[0] if first[0].error else ''}"
                f" (stage {first[0].stage}, attempts {first[0].attempts})\n"
            )
    report = await bus.aclose()
    out.write(
        f"shutdown: drained={report.drained} published={report.published} "
        f"completed={report.completed} dead_lettered={report.dead_lettered} "
        f"abandoned={len(report.abandoned)}\n"
    )
    return statistics
