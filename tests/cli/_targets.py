"""What the worker command's tests run: ``python -m asyncbus run _targets:NAME``.

Set up by environment variables, read at import:

* ``CLI_TEST_PREFIX``: run over Redis with this prefix (else in memory);
* ``CLI_TEST_BLOCK=1``: a job with ``"slow": true`` blocks until cancelled;
* a job with ``"gate": true`` waits (at most 30 s) until the test pushes to the Redis
  list ``{prefix}:gate``, holding the stage (one job at a time) until then;
* ``CLI_TEST_CONCURRENCY``: the jobs stage's consumers and capacity (default 1);
* ``CLI_TEST_CRASH=1``: the first job with ``"crash": true`` ends the process
  (``os._exit(17)``), once per prefix; its redelivery is handled.

Every job handled is counted in the Redis hash ``{prefix}:handled`` (field: the job's
``n``) and logged (``cli_test: handled``), so a test can wait for it on stderr.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio

from asyncbus import Bus, Envelope

URL = "redis://127.0.0.1:6379/0"
PREFIX = os.environ.get("CLI_TEST_PREFIX")
BLOCK = os.environ.get("CLI_TEST_BLOCK") == "1"
CRASH = os.environ.get("CLI_TEST_CRASH") == "1"
CONCURRENCY = int(os.environ.get("CLI_TEST_CONCURRENCY", "1"))

logger = logging.getLogger("cli_test")
_client: Any = None


def _redis() -> Any:
    global _client
    if _client is None:
        import redis.asyncio as aioredis

        _client = aioredis.Redis.from_url(URL)
    return _client


def _make_bus(name: str) -> Bus:
    transport = None
    if PREFIX is not None:
        from asyncbus.transports import RedisTransport

        transport = RedisTransport(URL, prefix=PREFIX, ack_timeout=2.0)
    made = Bus(transport=transport, name=name)
    # By default one job at a time, and no more held: a crash takes only that one down.
    made.subscribe("jobs", _job, group="workers", concurrency=CONCURRENCY, capacity=CONCURRENCY)
    return made


async def _job(envelope: Envelope) -> None:
    job = envelope.payload
    if BLOCK and job.get("slow"):
        logger.info("blocking", extra={"cli_test": "blocking", "n": job["n"]})
        await anyio.sleep_forever()
    if job.get("gate") and PREFIX is not None:
        await _redis().blpop([f"{PREFIX}:gate"], timeout=30)
    if job.get("exit"):
        raise SystemExit(0)  # not a failure: it stops the bus at once
    if CRASH and job.get("crash") and await _redis().set(f"{PREFIX}:crashed", 1, nx=True):
        os._exit(17)
    if PREFIX is not None:
        await _redis().hincrby(f"{PREFIX}:handled", str(job["n"]), 1)
    logger.info("handled", extra={"cli_test": "handled", "n": job["n"], "id": envelope.id})


bus = _make_bus("cli-test")


def factory() -> Bus:
    """A sync factory."""
    return _make_bus("from-factory")


async def async_factory() -> Bus:
    """An async factory."""
    await anyio.sleep(0)
    return _make_bus("from-async-factory")


def _starlette_app() -> Any:
    from starlette.applications import Starlette

    from asyncbus.integrations.starlette import lifespan

    return Starlette(lifespan=lifespan(_make_bus("in-starlette")))


def _fastapi_app() -> Any:
    import contextlib

    from fastapi import FastAPI

    from asyncbus.integrations.starlette import lifespan

    inner = lifespan(_make_bus("in-fastapi"))

    @contextlib.asynccontextmanager
    async def own_lifespan(app: FastAPI) -> Any:  # the bus's beside the app's own
        async with inner(app):
            yield

    return FastAPI(lifespan=own_lifespan)


def _app_publishing(job: dict[str, Any]) -> Any:
    """A Starlette app whose lifespan runs a bus and publishes ``job`` once it runs."""
    import contextlib

    from starlette.applications import Starlette

    from asyncbus.integrations.starlette import lifespan

    made = _make_bus("busy")

    @contextlib.asynccontextmanager
    async def busy(app: Starlette) -> Any:
        async with lifespan(made)(app):
            await made.publish("jobs", job)
            yield

    return Starlette(lifespan=busy)


starlette_app = _starlette_app()
busy_app = _app_publishing({"n": 0, "slow": True})  # a slow job in flight from the start
exiting_app = _app_publishing({"n": 0, "exit": True})
fastapi_app = _fastapi_app()
not_a_bus = 42


def needs_arguments(a: int, b: int) -> Bus:
    """Neither a factory nor an app."""
    raise AssertionError("never called")


def broken_factory() -> Bus:
    """Always raises: the worker crashes at start."""
    raise RuntimeError("the factory cannot make a bus")
