"""``python -m asyncbus bench postgres``: a tiny run against the local server reports every
side (the peers pgqueuer and procrastinate among them), the outbox's latency, the fan-out
table and every target.

Tiny counts and no timing assertions: the numbers are the benchmark's business; these
tests make sure it runs end to end, accounts for every envelope and judges the targets
when asked (``--check``).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from asyncbus.__main__ import main as asyncbus_main
from suite._postgres import SIDES, TARGETS, main
from suite._postgres_peers import PEERS

pytestmark = pytest.mark.timeout(180)


@pytest.mark.bench
def test_a_small_run_reports_every_side_the_latency_the_fanout_and_every_target(
    postgres_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    absent = [peer for peer, package in PEERS.items() if not importlib.util.find_spec(package)]
    if absent:
        pytest.skip(f"not installed: {', '.join(absent)} (pip install -e '.[bench]')")
    argv = ["--dsn", postgres_url, "--messages", "200", "--rounds", "3", "--check"]
    code = main([*argv, "--publishes", "10", "--fanout", "1,3"])
    out = capsys.readouterr().out
    assert "PostgreSQL (127.0.0.1:5432): 200 envelopes per run, 3 alternating rounds" in out
    assert "error" not in out  # every run handled and acked exactly its envelopes
    ratios = r"(?: +[\d.]+ \([\d.]+-[\d.]+\))+"
    for side in SIDES:
        row = rf"^  {side} +[\d,]+ +[\d.]+{ratios} +[\d,]+ [\d,]+ [\d,]+$"
        assert len(re.findall(row, out, re.M)) == 1, (side, out)
    fanout = re.findall(r"^ +([13]) +[\d.]+ +[\d.]+ \([\d.]+-[\d.]+\) +([\d.]+) ", out, re.M)
    assert fanout == [("1", "1.0"), ("3", "3.0")], out  # a row per group reached
    for peer in PEERS:
        assert (
            len(re.findall(rf"^  asyncbus / {peer}: [\d.]+ \([\d.]+-[\d.]+\) ", out, re.M)) == 1
        ), out
    assert "10 publishes per run" in out
    for path in ("transport", "outbox"):
        row = rf"^  {path} +[\d.]+ +[\d.]+ +[\d.]+   [\d.]+ [\d.]+ [\d.]+$"
        assert len(re.findall(row, out, re.M)) == 1, (path, out)
    assert re.search(r"^  outbox / transport p50: [\d.]+ \([\d.]+-[\d.]+\)", out, re.M), out
    verdicts = re.findall(r"^  (PASS|FAIL)  (.+?) vs (.+?) +>=? ", out, re.M)
    assert [(side, base) for _verdict, side, base in verdicts] == [
        (target.side, target.baseline) for target in TARGETS
    ]
    # Tiny runs may miss a target: the exit status says exactly that, nothing else.
    assert code == (1 if "FAIL" in [verdict for verdict, _side, _base in verdicts] else 0)


def test_a_server_that_is_down_is_skipped_with_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--dsn", "postgresql://postgres@127.0.0.1:1/test", "--check"]) == 0
    assert capsys.readouterr().out == "PostgreSQL: skipped (nothing listens on 127.0.0.1:1)\n"


def test_the_postgres_benchmark_is_a_bench_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        asyncbus_main(["bench", "postgres", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m asyncbus bench postgres [-h]")
