"""A TCP proxy for fault tests: forwards to a broker, and can cut or black-hole it.

    with TcpProxy(6379) as proxy:          # listens on 127.0.0.1:<proxy.port>
        url = f"redis://127.0.0.1:{proxy.port}/0"
        ...
        proxy.cut()          # close both sides of every connection (a broken network)
        proxy.blackhole()    # keep every socket open, forward nothing (a silent broker)
        proxy.refuse()       # cut everything and refuse new connections (broker down)
        proxy.forward()      # heal: forward again (black-holed connections are cut)

The proxy runs its own asyncio loop in a thread, so it keeps working whatever the
test's event loop (asyncio or trio) is doing. While black-holed, bytes from either
side are read and dropped, and new connections are accepted and held without an
upstream: a client sees a broker that accepts but never answers. While refusing, the
port is closed: connecting fails at once, as with a server that is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import TracebackType
from typing import Self

__all__ = ["TcpProxy"]

_CHUNK = 65536


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close a connection at once (RST, like a dropped link)."""
    with contextlib.suppress(Exception):
        writer.transport.abort()
        writer.close()


class _Pair:
    """One proxied connection: the client's socket and the broker's (if opened)."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None:
                _abort(writer)
        for task in self.tasks:
            task.cancel()


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` until told otherwise.

    :param target_port: the broker's port.
    :param target_host: the broker's host (loopback only in tests).
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._mode = "forward"
        self._pairs: set[_Pair] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        #: The handlers of accepted connections still setting them up (or swallowing).
        self._accepting: set[asyncio.Task[None]] = set()
        #: Connections accepted since the proxy started (a reconnect makes a new one).
        self.accepted = 0

    # -- life cycle -------------------------------------------------------------

    def start(self) -> Self:
        """Start listening on a free loopback port (:attr:`port`)."""
        self._thread.start()
        self._run(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, close every connection and stop the thread."""
        if not self._thread.is_alive():
            return
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- faults -----------------------------------------------------------------

    def cut(self) -> None:
        """Close both sides of every open connection; new ones are handled as the mode says."""
        self._run(self._cut())

    def blackhole(self) -> None:
        """Forward nothing from now on; keep every socket open."""
        self._run(self._set_mode("blackhole"))

    def refuse(self) -> None:
        """Cut every connection and refuse new ones (a broker that is down)."""
        self._run(self._refuse())

    def forward(self) -> None:
        """Forward again; connections that were black-holed are cut (their bytes are lost)."""
        self._run(self._heal())

    @property
    def connections(self) -> int:
        """Connections open through the proxy now."""
        return len(self._pairs)

    # -- the loop's side --------------------------------------------------------

    def _run(self, coroutine: object) -> None:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]
        future.result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        # A connection still being set up (its broker side opening) is cancelled too:
        # left pending, its handler or its pipes would outlive the loop.
        accepting = list(self._accepting)
        for task in accepting:
            task.cancel()
        tasks = [task for pair in self._pairs for task in pair.tasks]
        await self._cut()
        current = asyncio.current_task()
        waited = [*accepting, *tasks]
        await asyncio.gather(*(t for t in waited if t is not current), return_exceptions=True)

    async def _cut(self) -> None:
        pairs, self._pairs = list(self._pairs), set()
        for pair in pairs:
            pair.close()

    async def _set_mode(self, mode: str) -> None:
        self._mode = mode

    async def _refuse(self) -> None:
        self._mode = "refuse"
        if self._server is not None:
            self._server.close()  # the port refuses connections, as a stopped server's does
            self._server = None
        await self._cut()

    async def _heal(self) -> None:
        if self._mode in ("blackhole", "refuse"):
            await self._cut()
        if self._server is None:
            await self._listen()  # the same port again
        self._mode = "forward"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pair = _Pair(writer)
        self._pairs.add(pair)
        task = asyncio.current_task()
        assert task is not None
        self._accepting.add(task)
        try:
            await self._set_up(reader, pair)
        except asyncio.CancelledError:
            pair.close()
            self._pairs.discard(pair)
        finally:
            self._accepting.discard(task)

    async def _set_up(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        """Open the broker's side of ``pair`` and start its pipes (or swallow, black-holed)."""
        writer = pair.client
        if self._mode == "blackhole":
            await self._swallow(reader, pair)  # ends when the pair is closed (aborted)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            pair.close()
            self._pairs.discard(pair)
            return
        pair.upstream = up_writer
        if pair not in self._pairs:  # cut (or the proxy shut down) while it opened
            pair.close()
            return
        pair.tasks = [
            asyncio.ensure_future(self._pipe(reader, up_writer, pair)),
            asyncio.ensure_future(self._pipe(up_reader, writer, pair)),
        ]

    async def _swallow(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            while await reader.read(_CHUNK):
                pass
        pair.close()
        self._pairs.discard(pair)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pair: _Pair
    ) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                if self._mode == "blackhole":
                    continue  # dropped: the other side hears nothing
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if pair in self._pairs:
                self._pairs.discard(pair)
                pair.close()
