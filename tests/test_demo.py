"""``python -m asyncbus demo``: the pipeline, its table, and the dashboard with --serve."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request

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


@pytest.mark.timeout(60)
def test_the_demo_serves_its_dashboard_until_interrupted() -> None:
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
        deadline = time.monotonic() + 30
        while True:  # the demo is another process: ask its dashboard how far it got
            with urllib.request.urlopen(address[0] + "stats", timeout=10) as response:
                if b'"published":1000' in response.read().replace(b" ", b""):
                    break
            assert time.monotonic() < deadline, "the demo did not finish publishing"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0
    assert "shutdown: drained=True published=1000 completed=998 dead_lettered=2" in out
