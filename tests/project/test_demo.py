"""``python -m asyncbus demo``: the pipeline, its table, and the dashboard with --serve."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


@pytest.mark.timeout(60)
def test_the_demo_runs_the_pipeline_and_prints_an_exact_ledger() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncbus", "demo", "--orders", "300"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "published 300/300 orders" in out
    assert re.search(r"^orders\.created@mailer +300 +300 ", out, re.MULTILINE), out
    assert "audited 300, mailed 300 (each once, by competing consumers)" in out
    assert "dead letters by reason: {'handler_failed': 3}" in out
    assert "shutdown: drained=True published=1500 completed=1497 dead_lettered=3" in out
    # The failures were logged; the demo shows the records at the end, one line each.
    assert re.search(
        r"^the bus logged 2 record\(s\) \(logger 'asyncbus', WARNING and up\):\n"
        r"  WARNING asyncbus\.dead_letters: dead-lettered handler_failed: envelope \w+ on topic "
        r"'orders\.created' in stage 'orders\.created@payments' after 3 attempt\(s\): "
        r"RuntimeError: card 4111-13 declined\n"
        r"  WARNING asyncbus\.dead_letters: 2 more handler_failed record\(s\) for stage "
        r"'orders\.created@payments' were suppressed\n\Z",
        out,
        re.MULTILINE,
    ), out
    assert result.stderr == ""


def published(address: str) -> int:
    """How many envelopes the demo's bus admitted, asked through its dashboard's API."""
    with urllib.request.urlopen(address + "stats", timeout=10) as response:
        count: int = json.load(response)["published"]
        return count


@pytest.mark.timeout(60)
def test_the_served_demo_stays_live_until_interrupted() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncbus", "demo", "--orders", "200", "--serve", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()  # the first line names the dashboard
        address = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert address is not None, line
        with urllib.request.urlopen(address[0], timeout=10) as page:
            assert b"asyncbus" in page.read()
        # The demo is another process: ask its dashboard how far it got. Past the batch
        # of 200 orders (5 envelopes each), orders keep coming, so the page stays live.
        deadline = time.monotonic() + 30
        while published(address[0]) <= 1000:
            assert time.monotonic() < deadline, "the demo stopped publishing"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert "the dashboard stays live with 5 more orders a second; press Ctrl-C to stop" in out
    ledger = re.search(
        r"^shutdown: drained=True published=(\d+) completed=(\d+) dead_lettered=(\d+) "
        r"abandoned=0$",
        out,
        re.MULTILINE,
    )
    assert ledger is not None, out
    total, completed, dead = map(int, ledger.groups())
    assert total > 1000 and total % 5 == 0  # whole orders only, each through 5 stages
    assert total == completed + dead


def test_serve_without_its_extra_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    # As if the extra were not installed: importing starlette fails.
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['starlette'] = None\n")
    result = subprocess.run(
        [sys.executable, "-m", "asyncbus", "demo", "--serve"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "python -m asyncbus demo --serve needs starlette: pip install 'asyncbus[starlette]' "
        "uvicorn\n"
    )


def test_serve_on_a_port_in_use_says_so_in_one_line_and_exits_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "asyncbus", "demo", "--serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert result.returncode == 2
    assert result.stderr == (
        f"python -m asyncbus demo --serve cannot listen on 127.0.0.1:{port}: "
        "Address already in use\n"
    )


def test_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncbus", "--version"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout == f"asyncbus {importlib.metadata.version('asyncbus')}\n"


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--port", "abc"], "argument --port: must be an integer, got 'abc'"),
        (["--port", "70000"], "argument --port: must be an integer from 0 to 65535, got 70000"),
        (["--port", "-1"], "argument --port: must be an integer from 0 to 65535, got -1"),
        (["--serve", "--port", "65536"], "argument --port: must be an integer from 0 to 65535"),
        (["--orders", "-1"], "argument --orders: must be an integer >= 1, got -1"),
        (["--orders", "0"], "argument --orders: must be an integer >= 1, got 0"),
        (["--orders", "1.5"], "argument --orders: must be an integer, got '1.5'"),
        (["--orders", "many"], "argument --orders: must be an integer, got 'many'"),
    ],
)
def test_bad_demo_arguments_are_one_clear_line_and_exit_2(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from asyncbus.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["demo", *arguments])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m asyncbus demo: error: {said}"), err
    assert "Traceback" not in err


@pytest.mark.timeout(60)
def test_a_port_out_of_range_exits_2_from_the_command_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncbus", "demo", "--serve", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == (
        "python -m asyncbus demo: error: argument --port: must be an integer from 0 to 65535, "
        "got 70000"
    )
