"""A bus over a broker started and never closed: the process exits when its loop ends.

The loop's runner cancels every task left, the broker client's own included; the bus
stops at once (with its short grace to close with the broker), lists its work as
abandoned (the broker delivers it again) and says once what to do.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

pytestmark = pytest.mark.anyio

NEVER_CLOSED = "bus was never closed: use `async with bus`, `lifespan(bus)` or `await bus.aclose()`"

_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, logging, sys

    import anyio

    sys.path.insert(0, sys.argv[4])
    from _brokers import make_transport

    from asyncbus import Bus

    records = []


    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])


    logging.getLogger("asyncbus").addHandler(Keep())
    kind, url, prefix = sys.argv[1:4]
    bus = Bus(make_transport(kind, url, prefix))
    started = []


    @bus.subscribe("jobs", group="workers", concurrency=5)
    async def work(n: int) -> None:
        started.append(n)
        if len(started) == 5:
            every.set()
        await anyio.sleep(3600)


    async def main() -> None:
        global every
        every = anyio.Event()
        await bus.__aenter__()  # and never closed
        await bus.publish_many("jobs", range(5))
        await every.wait()


    asyncio.run(main())
    stage = bus.statistics().stage("jobs@workers")
    print(json.dumps({
        "records": records,
        "abandoned": stage.abandoned,
        "acked": stage.acked,
        "dead_letters": len(bus.dead_letters),
    }), flush=True)
    """
)


async def test_a_bus_never_closed_over_a_broker_stops_when_its_loop_ends(
    kind: str, url: str, unique_prefix: str, tmp_path: Path
) -> None:
    script = tmp_path / "never_closed.py"
    script.write_text(_SCRIPT)
    here = str(Path(__file__).parent)
    command = [sys.executable, str(script), kind, url, unique_prefix, here]
    with anyio.move_on_after(60) as waited:
        done = await anyio.run_process(command, check=False)
    if waited.cancelled_caught:
        pytest.fail(f"the process never exited over {kind}")
    stdout, stderr = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, stderr
    outcome = json.loads(stdout.strip().splitlines()[-1])

    assert (outcome["acked"], outcome["abandoned"], outcome["dead_letters"]) == (0, 5, 0)
    errors = [r for r in outcome["records"] if r[1] in ("ERROR", "CRITICAL")]
    assert len(errors) == 1, outcome["records"]
    assert errors[0][2].startswith(NEVER_CLOSED)
    assert "5 envelope(s) abandoned" in errors[0][2]
    assert not [r for r in outcome["records"] if "cancelled from outside" in r[2]]
    assert "HandlerCancelled" not in stderr
