"""A bus started and never closed: the process still exits when its event loop ends.

``await bus.__aenter__()`` in a start-up hook with no shutdown, or under ``asyncio.run``
without ``async with``: when the loop is torn down (its runner cancels every task left)
the bus stops at once, lists its work as abandoned, writes no dead letter for the
cancelled handlers, and says once what to do. Each case runs in a process of its own,
under a timeout: before the fix the process never exited.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("uvloop")

NEVER_CLOSED = "bus was never closed: use `async with bus`, `lifespan(bus)` or `await bus.aclose()`"

_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, logging, sys

    import anyio

    from asyncbus import Bus

    records = []


    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])


    logging.getLogger("asyncbus").addHandler(Keep())
    logging.getLogger("asyncbus").setLevel(logging.INFO)
    runner, then = sys.argv[1], sys.argv[2]
    bus = Bus()
    started = []


    @bus.subscribe("jobs", concurrency=2)
    async def work(n: int) -> None:
        started.append(n)
        if len(started) == 2:
            both.set()
        await anyio.sleep(3600)


    async def main() -> None:
        global both
        both = anyio.Event()
        await bus.__aenter__()  # and never closed
        for n in range(5):
            await bus.publish("jobs", n)  # two in the handler, three queued
        await both.wait()
        print("ready", flush=True)
        if then == "wait":
            await anyio.sleep_forever()  # until Ctrl-C


    try:
        if runner == "asyncio.run":
            asyncio.run(main())
        elif runner == "uvloop.run":
            import uvloop

            uvloop.run(main())
        elif runner == "anyio.run":
            anyio.run(main)
        elif runner == "anyio.run-uvloop":
            anyio.run(main, backend_options={"use_uvloop": True})
        else:
            anyio.run(main, backend="trio")
    except BaseException as error:
        ended = type(error).__name__
    else:
        ended = "returned"
    stage = bus.statistics().stages[0]
    print(json.dumps({
        "ended": ended,
        "records": records,
        "published": stage.published,
        "abandoned": stage.abandoned,
        "acked": stage.acked,
        "dead_letters": len(bus.dead_letters),
        "running": bus.running,
    }), flush=True)
    """
)

ASYNCIO_RUNNERS = ["asyncio.run", "uvloop.run", "anyio.run", "anyio.run-uvloop"]


def _run(tmp_path: Path, runner: str, then: str) -> dict[str, Any]:
    script = tmp_path / "never_closed.py"
    script.write_text(_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), runner, then],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if then == "wait":
            # (Nothing but this line is written before the signal: communicate() below
            # misses nothing the line reader buffered.)
            assert process.stdout is not None
            assert process.stdout.readline() == "ready\n"
            process.send_signal(signal.SIGINT)  # Ctrl-C, once
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"the process never exited ({runner}, {then}):\n{err[-3000:]}")
    lines = out.strip().splitlines()
    assert lines, f"no outcome ({runner}, {then}), exit status {process.returncode}:\n{err}"
    outcome: dict[str, Any] = json.loads(lines[-1])
    outcome["stderr"] = err
    return outcome


@pytest.mark.parametrize("then", ["return", "wait"])
@pytest.mark.parametrize("runner", ASYNCIO_RUNNERS)
def test_a_bus_never_closed_stops_when_its_asyncio_loop_ends(
    tmp_path: Path, runner: str, then: str
) -> None:
    outcome = _run(tmp_path, runner, then)

    assert outcome["ended"] == ("returned" if then == "return" else "KeyboardInterrupt")
    # Stopped, its work listed as abandoned: no false dead letter for the two handlers
    # the loop cancelled, nothing acked, nothing left running.
    assert (outcome["published"], outcome["abandoned"], outcome["acked"]) == (5, 5, 0)
    assert outcome["dead_letters"] == 0
    assert outcome["running"] is False
    # One line says what happened and what to do; nothing about stray cancellations.
    warnings = [r for r in outcome["records"] if r[1] in ("WARNING", "ERROR", "CRITICAL")]
    assert len(warnings) == 1, warnings
    name, level, message = warnings[0]
    assert (name, level) == ("asyncbus.bus", "ERROR")
    assert message.startswith(NEVER_CLOSED)
    assert "5 envelope(s) abandoned" in message
    assert "HandlerCancelled" not in outcome["stderr"]


@pytest.mark.parametrize("then", ["return", "wait"])
def test_a_bus_never_closed_under_trio_ends_with_the_run_and_no_false_dead_letter(
    tmp_path: Path, then: str
) -> None:
    # trio cannot hang here: a task may not return with a nursery open, so trio cancels
    # the bus's task group when the task that started it returns and then reports the
    # misnesting itself (its cancel scopes being misnested by then, a handler's
    # ``sleep`` may even return early: what becomes of the work is trio's). The bus must
    # not make a dead letter of that cancellation.
    outcome = _run(tmp_path, "anyio.run-trio", then)

    assert outcome["ended"] != "returned"  # trio's own error for the open nursery
    assert outcome["dead_letters"] == 0
    assert not [r for r in outcome["records"] if "dead-lettered" in r[2]]
    assert "HandlerCancelled" not in outcome["stderr"]
