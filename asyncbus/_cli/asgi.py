"""Run an ASGI app's lifespan as a server does, without serving its HTTP routes."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio

from . import CommandError, Exit

__all__ = ["lifespan_of"]


class _Lifespan:
    """One run of the ASGI lifespan protocol: startup, then shutdown when asked."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.state: dict[str, Any] = {}
        self.started = anyio.Event()
        self.finished = anyio.Event()
        self.shutdown_asked = anyio.Event()
        self.asked_startup = False
        self.failure: str | None = None
        self.error: BaseException | None = None
        #: The scope of the code that runs while the app is up, once it is up.
        self.body: anyio.CancelScope | None = None
        self.ended_early = False

    async def receive(self) -> dict[str, Any]:
        if not self.asked_startup:
            self.asked_startup = True
            return {"type": "lifespan.startup"}
        await self.shutdown_asked.wait()
        return {"type": "lifespan.shutdown"}

    async def send(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind in ("lifespan.startup.failed", "lifespan.shutdown.failed"):
            self.failure = str(message.get("message") or kind)
        if kind in ("lifespan.startup.complete", "lifespan.startup.failed"):
            self.started.set()

    async def run(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.0"},
            "state": self.state,
        }
        try:
            await self.app(scope, self.receive, self.send)
        except anyio.get_cancelled_exc_class():
            raise
        except BaseException as error:
            # Told by the context manager, in the task that runs it: not by the task
            # group, and never out of this task (on asyncio a SystemExit or
            # KeyboardInterrupt leaving a task stops the event loop itself).
            self.error = error
        finally:
            self.finished.set()
            self.started.set()
            if self.body is not None and not self.shutdown_asked.is_set():
                self.ended_early = True
                self.body.cancel()  # the app ended on its own: interrupt whoever runs it


@contextlib.asynccontextmanager
async def lifespan_of(app: Any) -> AsyncIterator[dict[str, Any]]:
    """Start ``app``'s lifespan, yield its lifespan state, shut it down on exit.

    If the lifespan ends by itself (its bus stopped, say), the body is interrupted and
    the exit raises the lifespan's error.

    :raises CommandError: when the app does not support the lifespan protocol.
    :raises Exception: what the app's startup (or an early end) raised.
    """
    lifespan = _Lifespan(app)
    failure: Exception | None = None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lifespan.run)
        await lifespan.started.wait()
        if lifespan.failure is None and not lifespan.finished.is_set():
            with anyio.CancelScope() as lifespan.body:
                try:
                    yield lifespan.state
                except Exception as error:  # the body's: raised below, not in a group
                    failure = error
                    tasks.cancel_scope.cancel()
                finally:
                    lifespan.shutdown_asked.set()
        # Otherwise the startup failed: the app ends by itself, and the group waits for it.
    if failure is not None:
        raise failure
    if not lifespan.shutdown_asked.is_set():
        _raise_ended(lifespan, during="startup")
    elif lifespan.ended_early:
        _raise_ended(lifespan, during="run")
    elif lifespan.error is not None or lifespan.failure is not None:
        _raise_ended(lifespan, during="shutdown")


def _raise_ended(lifespan: _Lifespan, *, during: str) -> None:
    if lifespan.error is not None:
        raise lifespan.error
    if during == "startup" and lifespan.failure is None:
        raise CommandError(
            "the app's lifespan returned without starting up: the app does not support "
            "the ASGI lifespan protocol"
        )
    raise CommandError(
        f"the app's lifespan failed during {during}: {lifespan.failure or 'it ended early'}",
        code=Exit.CRASHED,
    )
