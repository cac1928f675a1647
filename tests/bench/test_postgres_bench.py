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
from suite._postgres import OUTBOX_JUDGED, SIDES, TARGETS, latency_verdict, main
from suite._postgres_latency import OUTBOX_PATHS, PATHS, Latencies
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
    for path in PATHS:
        row = rf"^  {path} +[\d.]+ +[\d.]+ +[\d.]+   [\d.]+ [\d.]+ [\d.]+$"
        assert len(re.findall(row, out, re.M)) == 1, (path, out)
    for path in OUTBOX_PATHS:
        ratio = rf"^  {path} / transport p50: [\d.]+ \([\d.]+-[\d.]+\)$"
        assert len(re.findall(ratio, out, re.M)) == 1, (path, out)
    verdicts = re.findall(r"^  (PASS|FAIL)  (.+?) vs (.+?) +>=? ", out, re.M)
    assert [(side, base) for _verdict, side, base in verdicts] == [
        (target.side, target.baseline) for target in TARGETS
    ]
    latency = re.findall(
        rf"^  (PASS|FAIL)  {OUTBOX_JUDGED} vs transport \(p50\) +<= 1.2x +[\d.]+x ", out, re.M
    )
    assert len(latency) == 1, out
    # Tiny runs may miss a target: the exit status says exactly that, nothing else.
    failed = "FAIL" in [verdict for verdict, _side, _base in verdicts] + latency
    assert code == (1 if failed else 0)


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


def test_the_outbox_target_fails_with_a_note_when_its_broker_did_not_answer() -> None:
    skipped = {OUTBOX_JUDGED: "nothing listens on 127.0.0.1:1"}
    verdict = latency_verdict({}, skipped)
    assert (verdict.verdict, verdict.measured) == ("FAIL", "nothing listens on 127.0.0.1:1")


def test_the_outbox_target_is_judged_on_the_median_of_the_rounds() -> None:
    def runs(*p50s: float) -> list[Latencies]:
        return [Latencies([p50], [p50]) for p50 in p50s]

    found = {"transport": runs(1.0, 1.0, 1.0), OUTBOX_JUDGED: runs(1.1, 1.3, 1.2)}
    assert latency_verdict(found, {}).verdict == "PASS"  # (median 1.2x: at the goal)
    found[OUTBOX_JUDGED] = runs(1.1, 1.3, 1.25)
    verdict = latency_verdict(found, {})
    assert (verdict.verdict, verdict.measured) == ("FAIL", "1.250x (rounds 1.10-1.30)")
