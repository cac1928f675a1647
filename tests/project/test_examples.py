"""Every program in examples/ runs and says what it should.

The scripts run as a user runs them, ``python examples/NAME.py`` in a subprocess; the
FastAPI services are driven in-process through httpx's ASGI transport with their
lifespan, and the in-memory one is also served by uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

#: script -> lines (regular expressions) its output must contain, in order.
SCRIPTS = {
    "work_queue.py": [
        r"stage images\.uploaded@resizers: concurrency 3, published 30, acked 30, "
        r"dead-lettered 0",
        r"30 jobs, each handled exactly once by one of \d workers; audit saw all 30",
    ],
    "cpu_pipeline.py": [
        r"request through the slip returned sum=14 digest=[0-9a-f]{16}",
        r"checksum@hasher +acked +41 ",
        r"event loop stayed responsive: \d+ heartbeats",
        r"pipeline done: 40 lines parsed, checksummed on the worker pool and stored",
    ],
    "dead_letters.py": [
        # The bus logs each dead letter; the script sends those records to stdout.
        r"log: WARNING asyncbus\.dead_letters: dead-lettered rejected: envelope \w+ on topic "
        r"'payments\.requested' in stage 'payments\.requested@charger' after 1 attempt\(s\): "
        r"Reject: amount must be positive, got -5\n",
        r"4 dead letters, 4 alerts raised:",
        r"handler_failed +stage=payments\.requested@charger  attempts=3  "
        r"error=ConnectionError: payment gateway unreachable",
        r"replayed 2 dead letters: orders \[1, 2\] charged",
        r"left in the queue: no_subscribers \(refunds\.requested\), "
        r"rejected \(payments\.requested\)",
        r"purged 2; the queue is empty: True",
        r"published 5 = acked 2 \+ dead-lettered 3",
        r"log: WARNING asyncbus\.dead_letters: 1 more handler_failed record\(s\) for stage "
        r"'payments\.requested@charger' were suppressed\n",
    ],
    "tracing.py": [
        r"one trace, 10 spans, trace id [0-9a-f]{32}:",
        r"\nPOST /orders \[SERVER\] [\d.]+ ms",
        r"\n  publish orders.created \[PRODUCER\] [\d.]+ ms",
        r"\n    process orders.created \[CONSUMER\] [\d.]+ ms  group=fulfil  attempt=1  retry"
        r"  event: retry",
        r"\n    process orders.created \[CONSUMER\] [\d.]+ ms  group=fulfil  attempt=2  acked"
        r"  linked to the first attempt",
        r"\n      forward orders.invoice \[PRODUCER\] [\d.]+ ms",
        r"\n        process orders.invoice \[CONSUMER\] [\d.]+ ms  group=billing  attempt=1"
        r"  acked",
        r"\n          request tax.quote \[PRODUCER\] [\d.]+ ms",
        r"\n            process tax.quote \[CONSUMER\] [\d.]+ ms  group=tax  attempt=1  acked",
        r"\n              reply \[PRODUCER\] [\d.]+ ms",
        r"\n        process orders.invoice \[CONSUMER\] [\d.]+ ms  group=audit  attempt=1"
        r"  acked",
    ],
}
#: examples that are apps, not scripts; tested below.
APPS = {"fastapi_orders.py", "outbox_orders.py"}
#: scripts that need a broker on this machine; tested below.
BROKER_SCRIPTS = {"scaled_out_redis.py"}


def run_example(name: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``examples/name`` as ``python examples/name`` from the repository root."""
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_every_example_is_run_by_a_test() -> None:
    assert {path.name for path in EXAMPLES.glob("*.py")} == set(SCRIPTS) | APPS | BROKER_SCRIPTS


@pytest.mark.timeout(120)
def test_the_service_scaled_out_over_redis_splits_the_orders_between_two_processes(
    require_service: Callable[[str, int], None],
) -> None:
    require_service("Redis", 6379)
    result = run_example("scaled_out_redis.py", timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    shares = re.search(
        r"^200 orders fulfilled by two processes \(worker-1: (\d+), worker-2: (\d+)\)$",
        result.stdout,
        re.MULTILINE,
    )
    assert shares is not None, result.stdout
    assert int(shares[1]) + int(shares[2]) == 200
    assert "each exactly once: True" in result.stdout


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_example_script_runs_and_prints_its_result(name: str) -> None:
    result = run_example(name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    position = 0
    for pattern in SCRIPTS[name]:
        found = re.compile(pattern).search(result.stdout, position)
        assert found, f"{pattern!r} not in the output (after {position}):\n{result.stdout}"
        position = found.end()


def test_example_scripts_end_with_asyncbus_run() -> None:
    for name in SCRIPTS:
        source = (EXAMPLES / name).read_text()
        assert source.startswith('"""'), f"{name} needs a docstring on how to run it"
        assert f"python examples/{name}" in source
        assert source.rstrip().endswith("asyncbus.run(main)"), name


# -- the FastAPI service ------------------------------------------------------------

_modules = itertools.count()


def load_example(name: str) -> ModuleType:
    """Import a fresh copy of ``examples/name`` (its bus and state are module state)."""
    pytest.importorskip("fastapi")
    module_name = f"_example_{name.removesuffix('.py')}_{next(_modules)}"
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def load_fastapi_example() -> ModuleType:
    """Import a fresh copy of examples/fastapi_orders.py (its bus and stock are module state)."""
    pytest.importorskip("uvicorn")
    return load_example("fastapi_orders.py")


@pytest.fixture
def orders_service() -> Iterator[ModuleType]:
    module = load_fastapi_example()
    try:
        yield module
    finally:
        sys.modules.pop(module.__name__, None)


@pytest.mark.anyio
async def test_fastapi_example_publishes_orders_and_serves_the_admin_app(
    orders_service: ModuleType,
) -> None:
    httpx = pytest.importorskip("httpx")
    app, bus, token = orders_service.app, orders_service.bus, orders_service.ADMIN_TOKEN
    admin = {"Authorization": f"Bearer {token}"}
    transport = httpx.ASGITransport(app=app)
    with anyio.fail_after(20):
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://orders") as client,
        ):
            assert bus.running
            accepted = await client.post("/orders", json={"id": 1, "item": "book", "quantity": 2})
            assert accepted.status_code == 202
            assert accepted.json()["stages"] == [
                "orders.created@mailer",
                "orders.created@warehouse",
            ]
            out_of_stock = await client.post(
                "/orders", json={"id": 2, "item": "lamp", "quantity": 1}
            )
            assert out_of_stock.status_code == 202
            invalid = await client.post("/orders", json={"id": 3, "item": "pen", "quantity": 0})
            assert invalid.status_code == 422
            await bus.drain(timeout=5)

            assert (await client.get("/admin/stats")).status_code == 401
            stats = (await client.get("/admin/stats", headers=admin)).json()
            ledger = {
                stage["name"]: (stage["published"], stage["acked"], stage["dead_lettered"])
                for stage in stats["stages"]
            }
            assert ledger == {
                "orders.created@mailer": (2, 2, 0),
                "orders.created@warehouse": (2, 1, 1),
            }
            dead = (await client.get("/admin/dead-letters", headers=admin)).json()
            assert [item["reason"] for item in dead["items"]] == ["rejected"]
            assert "not enough 'lamp' in stock for order 2" in dead["items"][0]["error"]
            assert orders_service.stock == {"book": 8, "pen": 100}
            page = await client.get("/admin/", headers=admin)
            assert page.status_code == 200
            assert "text/html" in page.headers["content-type"]
        assert not bus.running


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.timeout(90)
def test_fastapi_example_serves_over_uvicorn_and_drains_on_shutdown() -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    port = free_port()
    env = {**os.environ, "PORT": str(port), "ADMIN_TOKEN": "example-token"}
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "fastapi_orders.py")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    admin = {"Authorization": "Bearer example-token"}
    try:
        with httpx.Client(base_url=base, timeout=5) as client:
            deadline = time.monotonic() + 30
            while True:
                try:
                    client.get("/admin/stats", headers=admin)
                    break
                except httpx.TransportError:
                    assert server.poll() is None, "the server exited early"
                    assert time.monotonic() < deadline, "the server did not start in 30s"
                    time.sleep(0.1)
            response = client.post("/orders", json={"id": 7, "item": "pen", "quantity": 3})
            assert response.status_code == 202
            deadline = time.monotonic() + 10
            while True:
                stats = client.get("/admin/stats", headers=admin).json()
                acked = sorted(stage["acked"] for stage in stats["stages"])
                if acked == [1, 1]:
                    break
                assert time.monotonic() < deadline, stats
                time.sleep(0.05)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
            pytest.fail(f"the server did not stop within 30s of SIGINT:\n{output}")
    assert server.returncode == 0, output
    assert f"admin dashboard: http://127.0.0.1:{port}/admin/?token=example-token" in output
    assert "mailer: confirmation sent for order 7" in output
    assert "warehouse: reserved 3 x pen for order 7" in output
    assert "Application shutdown complete." in output


# -- the order service on PostgreSQL ---------------------------------------------------


async def drop_schemas(dsn: str, *schemas: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(dsn, timeout=5)
    try:
        for schema in schemas:
            await connection.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    finally:
        await connection.close()


@pytest.mark.anyio
@pytest.mark.backends("asyncio")
@pytest.mark.timeout(60)
async def test_postgres_orders_example_publishes_with_the_order_and_takes_stock_once(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    httpx = pytest.importorskip("httpx")
    asyncpg = pytest.importorskip("asyncpg")
    schema = f"orders_{uuid.uuid4().hex[:8]}"
    schemas = (schema, f"{schema}_bus", f"{schema}_inbox")
    monkeypatch.setenv("ORDERS_DSN", postgres_dsn)
    monkeypatch.setenv("ORDERS_SCHEMA", schema)
    service = load_example("outbox_orders.py")
    app, bus = service.app, service.bus
    transport = httpx.ASGITransport(app=app)
    try:
        with anyio.fail_after(45):
            async with (
                app.router.lifespan_context(app),
                httpx.AsyncClient(transport=transport, base_url="http://orders") as client,
            ):
                book = await client.post("/orders", json={"product": "book", "quantity": 2})
                pens = await client.post("/orders", json={"product": "pen", "quantity": 5})
                # The order row and its message are written, then the commit fails.
                lamp = await client.post("/orders", json={"product": "lamp", "quantity": 1})
                assert (book.status_code, pens.status_code) == (201, 201)
                assert lamp.status_code == 422
                assert lamp.json() == {"detail": "no product 'lamp'"}
                await bus.drain(timeout=20)
                assert (await client.get("/stock")).json() == {"book": 8, "pen": 95}

                # The book order's envelope once more, same id: a redelivery.
                order = book.json()
                copy = await bus.publish(
                    "orders.created",
                    {"id": order["id"], "product": "book", "quantity": 2},
                    id=order["message"],
                )
                assert copy.accepted == ("orders.created@stock",)
                await bus.drain(timeout=20)
                assert (await client.get("/stock")).json() == {"book": 8, "pen": 95}

                stage = bus.statistics().stage("orders.created@stock")
                # Three envelopes reached the stage (two orders, one copy); all acked, the
                # copy skipped by the inbox. The rolled-back one never existed.
                assert (stage.published, stage.acked, stage.dead_lettered) == (3, 3, 0)
                assert bus.dead_letters.list() == []
            assert not bus.running

        connection = await asyncpg.connect(postgres_dsn, timeout=5)
        try:
            orders = await connection.fetch(
                f"SELECT id, product, quantity FROM {schema}.orders ORDER BY id"
            )
            messages = await connection.fetchval(f"SELECT count(*) FROM {schema}_bus.messages")
            claims = await connection.fetch(
                f"SELECT stage, envelope_id FROM {schema}_inbox.claims ORDER BY envelope_id"
            )
        finally:
            await connection.close()
        assert [tuple(row) for row in orders] == [
            (order["id"], "book", 2),
            (pens.json()["id"], "pen", 5),
        ]
        assert messages == 0
        assert sorted(tuple(row) for row in claims) == sorted(
            ("orders.created@stock", message)
            for message in (order["message"], pens.json()["message"])
        )
    finally:
        sys.modules.pop(service.__name__, None)
        await drop_schemas(postgres_dsn, *schemas)
