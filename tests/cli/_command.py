"""``python -m asyncbus run ...`` in a subprocess, its JSON log records read as they come."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process
from anyio.streams.text import TextReceiveStream

HERE = Path(__file__).resolve().parent
Record = dict[str, Any]


class Running:
    """A running command: its records (one per stderr line) and its exit."""

    def __init__(self, process: Process) -> None:
        self.process = process
        self.records: list[Record] = []
        self.ended = False
        self._grew = anyio.Event()

    async def read(self) -> None:
        assert self.process.stderr is not None
        pending = ""
        try:
            async for chunk in TextReceiveStream(self.process.stderr):
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    self._add(line)
        finally:
            if pending:
                self._add(pending)
            self.ended = True
            self._grew.set()

    def _add(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            record = {"raw": line}
        if not isinstance(record, dict):
            record = {"raw": line}
        self.records.append(record)
        self._grew.set()
        self._grew = anyio.Event()

    def matching(self, predicate: Callable[[Record], bool]) -> list[Record]:
        return [record for record in self.records if predicate(record)]

    async def wait_for(
        self, predicate: Callable[[Record], bool], count: int = 1, timeout: float = 30
    ) -> list[Record]:
        """The first ``count`` records matching ``predicate``, waiting for them to come."""
        with anyio.move_on_after(timeout):
            while True:
                found = self.matching(predicate)
                if len(found) >= count or self.ended:
                    break
                await self._grew.wait()
        found = self.matching(predicate)
        if len(found) < count:
            ended = "ended" if self.ended else f"still ran after {timeout:g}s"
            raise AssertionError(
                f"the command {ended} with {len(found)} of {count} records expected; its log:\n"
                + self.text()
            )
        return found[:count]

    async def wait_for_event(self, event: str, count: int = 1, timeout: float = 30) -> list[Record]:
        """The first ``count`` records with ``asyncbus_event == event`` (``running``...)."""
        return await self.wait_for(lambda r: r.get("asyncbus_event") == event, count, timeout)

    def handled(self) -> list[int]:
        """The jobs the command's handlers logged as handled, in order."""
        return [r["n"] for r in self.records if r.get("cli_test") == "handled"]

    def report(self) -> Record:
        """The shutdown report the command logged (exactly one)."""
        reports = [r["asyncbus_report"] for r in self.records if "asyncbus_report" in r]
        assert len(reports) == 1, self.text()
        report: Record = reports[0]
        return report

    def text(self) -> str:
        return "\n".join(r.get("raw") or r.get("message", "") for r in self.records)

    def send(self, number: int) -> None:
        self.process.send_signal(signal.Signals(number))

    async def exit_code(self, timeout: float = 30) -> int:
        """Wait for the command to exit (and its output to end); its status."""
        with anyio.fail_after(timeout):
            code = await self.process.wait()
            while not self.ended:
                await self._grew.wait()
        return code

    async def stop(self, number: int = signal.SIGTERM, timeout: float = 30) -> int:
        self.send(number)
        return await self.exit_code(timeout)

    def worker_pids(self) -> list[int]:
        return [
            r["pid"] for r in self.records if r.get("asyncbus_event") == "running" and "pid" in r
        ]


@contextlib.asynccontextmanager
async def run_command(
    *arguments: str, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> AsyncIterator[Running]:
    """``python -m asyncbus run ARGUMENTS --log-format json``; killed (with its workers)
    if still running at the end of the block."""
    environment = {**os.environ, **(env or {})}
    process = await anyio.open_process(
        [sys.executable, "-m", "asyncbus", "run", *arguments, "--log-format", "json"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=environment,
        cwd=cwd,
    )
    running = Running(process)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(running.read)
        try:
            yield running
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                for pid in running.worker_pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with anyio.move_on_after(10):
                    while not running.ended:
                        await running._grew.wait()
                tasks.cancel_scope.cancel()
