"""The benchmark suite (benchmarks/suite): every workload runs, counts right, and reports.

Tiny counts, no timing assertions: the numbers are the suite's business, these
tests only make sure that a change to the bus does not quietly break it. The runs
of every workload are marked ``bench`` (``pytest -m bench``); the default run keeps
one quick run of the suite through ``python -m asyncbus bench``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import cpu_stages
import pytest

import asyncbus
from asyncbus.__main__ import NO_SUITE
from asyncbus.__main__ import main as asyncbus_main
from suite import _runner, main
from suite._memory import measure_memory
from suite._model import Impl, Measurement, Sample
from suite._report import check_targets, render_comparisons, render_table
from suite._runner import WORKLOADS, Plan, measure

LOOPS = ["asyncio", "trio"]


@pytest.mark.bench
@pytest.mark.parametrize("loop", LOOPS)
def test_every_workload_runs_on_asyncbus_and_its_baselines(loop: str) -> None:
    impls = ("asyncbus", "raw", "queue", "sync", "floor")
    plan = Plan(messages=200, requests=50, rounds=3, impls=impls)
    for workload in WORKLOADS:
        measured = {m.impl.key: m for m in measure(workload, loop, plan)}
        for key in ("asyncbus", "raw", "sync"):
            assert measured[key].status == "ok", (workload.key, key, measured[key].reason)
            assert len(measured[key].samples) == 3
        # The fairness floor runs on workload 1 only and says so elsewhere.
        assert measured["floor"].status == ("ok" if workload.key == "1" else "n/a")
        assert measured["asyncbus"].ratio is not None
        if workload.latency:
            assert measured["asyncbus"].p99_ratio is not None
        expected_queue = "ok" if loop == "asyncio" else "n/a"
        assert measured["queue"].status == expected_queue


def test_python_m_asyncbus_bench_runs_the_checkouts_suite(tmp_path: Path) -> None:
    # The one quick run of the suite in the default test run, through the thin entry.
    path = tmp_path / "bench.json"
    argv = ["bench", "--workloads", "1,5", "--impls", "asyncbus,raw", "--messages", "100"]
    argv += ["--requests", "50", "--loops", "asyncio", "--no-memory", "--json", str(path)]
    # --check judges the targets; tiny runs on a busy machine may miss one of the ratios to
    # the raw stream: the exit status says exactly that, nothing else.
    code = asyncbus_main([*argv, "--check"])
    document = json.loads(path.read_text())
    judged = [check["verdict"] for check in document["targets"]["checks"]]
    assert code == (1 if any(verdict.startswith("FAIL") for verdict in judged) else 0)
    results = {(r["workload"], r["impl"]): r for r in document["results"]}
    assert set(results) == {("1", "asyncbus"), ("1", "raw"), ("5", "asyncbus"), ("5", "raw")}
    assert results[("1", "raw")]["ratio_to_raw"] == 1.0
    assert results[("5", "asyncbus")]["p99_us"] > 0
    verdicts = {check["name"]: check["verdict"] for check in document["targets"]["checks"]}
    assert verdicts["envelope overhead"].startswith("SKIP")


def test_the_faststream_target_is_judged_per_round_and_shows_the_fairness_floor() -> None:
    [workload] = [w for w in WORKLOADS if w.key == "1"]

    def measured(key: str, seconds: list[float]) -> Measurement:
        samples = [Sample(s, 1_000, 1_000) for s in seconds]
        return Measurement(workload, "uvloop", Impl(key, key, None), samples, ratio=1.0)

    # Rates per round: asyncbus 100k, 40k, 100k; FastStream 2k, 1k, 2.5k; floor 200k x3.
    runs = [
        measured("asyncbus", [0.01, 0.025, 0.01]),
        measured("raw", [0.01, 0.01, 0.01]),
        measured("floor", [0.005, 0.005, 0.005]),
        measured("faststream", [0.5, 1.0, 0.4]),
    ]
    [target] = [t for t in check_targets(runs, None, "uvloop") if "FastStream" in t.name]
    # Per-round ratios 50, 40, 40 (median 40); the floor's 100, 200, 80 (median 100).
    assert (target.value, target.passed, target.note) == ("40x", False, "fairness floor 100x")


def test_memory_run_reports_overhead_per_envelope() -> None:
    report = measure_memory("asyncio", capacity=2_000, sustained=4_000, traced=1_000)
    assert report.depth_sustained and min(report.depth_sustained) > 0
    assert 0 < report.overhead_per_envelope < 10_000
    assert report.raw_overhead_per_item < report.overhead_per_envelope


def test_the_bench_help_names_the_broker_benchmarks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        asyncbus_main(["bench", "--help"])
    assert exited.value.code == 0
    # argparse wraps the epilog, at spaces and after hyphens
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert text.startswith("usage: python -m asyncbus bench [-h] [--quick]")
    assert "'python -m asyncbus bench brokers' (Redis Streams and NATS JetStream vs" in text
    assert "'python -m asyncbus bench rabbit' (RabbitMQ vs hand-written aio-pika)" in text
    assert "'python -m asyncbus bench postgres' (PostgreSQL vs hand-written asyncpg)" in text


def test_the_cpu_stages_benchmark_is_a_bench_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        asyncbus_main(["bench", "cpu", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: python -m asyncbus bench cpu [-h]")
    assert "--scaling" in text and "--free-threaded PYTHON" in text


def test_the_rabbit_benchmark_is_a_bench_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    # `bench brokers` and its runs against the local servers: tests/transports/test_broker_bench.py
    with pytest.raises(SystemExit) as exited:
        asyncbus_main(["bench", "rabbit", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m asyncbus bench rabbit [-h]")


SMALL = ["--messages", "100", "--requests", "50", "--rounds", "3", "--no-memory"]


@pytest.mark.bench
def test_by_default_it_reports_ratios_and_exits_0_whatever_the_peers_do(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*SMALL, "--workloads", "1,5", "--loops", "asyncio,trio"]
    assert main([*argv, "--impls", "asyncbus,raw,floor,queue,bubus"]) == 0
    out = capsys.readouterr().out
    assert "targets" not in out and "PASS" not in out and "FAIL" not in out
    assert "issue" not in out
    assert "\nasyncbus / peer on workload 1 (asyncio; median of per-round ratios):\n" in out
    assert re.search(r"^  bubus EventBus +[\d,.]+x   \(the fairness floor: [\d,]+x\)$", out, re.M)
    # The table fits 100 columns; what cannot run on trio is said once, below it.
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "workload 1: one stage, one async handler (trio)" in out
    assert out.count("needs an asyncio event loop") == 1  # asyncio.Queue and bubus: one line
    assert (
        "  asyncio.Queue, bubus EventBus — needs an asyncio event loop (workloads 1,5 on trio)"
        in out
    )


def test_a_failing_asyncbus_run_is_an_error_and_exit_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def broken(messages: object) -> Sample:
        raise ModuleNotFoundError("No module named 'sniffio'")

    monkeypatch.setattr(_runner, "bus_runners", lambda: dict.fromkeys("123456", broken))
    assert main([*SMALL, "--workloads", "1", "--loops", "asyncio", "--impls", "asyncbus,raw"]) == 1
    captured = capsys.readouterr()
    row = "  asyncbus                    error: ModuleNotFoundError: No module named 'sniffio'"
    assert row in captured.out.splitlines()
    assert (
        "asyncbus failed on workload 1 (asyncio): ModuleNotFoundError: No module named 'sniffio'"
        in captured.err
    )


NOT_INSTALLED = "not installed: faststream (pip install -e '.[bench]')"
ASYNCIO_ONLY = "needs an asyncio event loop"
FASTSTREAM = ("faststream", "FastStream TestNatsBroker")
FASTSTREAM_RABBIT = ("faststream-rabbit", "FastStream TestRabbitBroker")
BUBUS = ("bubus", "bubus EventBus")


def not_run(impl: tuple[str, str], loop: str, reason: str) -> list[Measurement]:
    """``impl``'s rows on every workload on ``loop``, each not run for ``reason``."""
    rows = [Measurement(w, loop, Impl(*impl, None, reason)) for w in WORKLOADS]
    for row in rows:
        row.status, row.reason = "n/a", reason
    return rows


def test_a_peer_missing_its_extra_is_one_line_below_the_table() -> None:
    rows = not_run(FASTSTREAM, "asyncio", NOT_INSTALLED) + not_run(
        FASTSTREAM, "uvloop", NOT_INSTALLED
    )
    table = render_table(rows)
    assert table.count("not installed: faststream") == 1
    assert table.splitlines()[-2:] == [
        "not run:",
        "  FastStream TestNatsBroker — not installed: faststream (pip install -e '.[bench]')",
    ]


def test_rows_not_run_for_one_reason_share_one_line_that_fits_100_columns() -> None:
    rows = []
    for loop in ("asyncio", "uvloop", "trio"):
        for impl in (FASTSTREAM, FASTSTREAM_RABBIT):
            rows += not_run(impl, loop, ASYNCIO_ONLY if loop == "trio" else NOT_INSTALLED)
        if loop == "trio":
            rows += not_run(BUBUS, loop, ASYNCIO_ONLY)
    table = render_table(rows).splitlines()
    assert table[-6:] == [
        "",
        "not run:",
        "  FastStream TestNatsBroker, FastStream TestRabbitBroker — not installed: faststream",
        "    (pip install -e '.[bench]') (workloads 1,2,3,4,5,6,7,8 on asyncio, uvloop)",
        "  FastStream TestNatsBroker, FastStream TestRabbitBroker, bubus EventBus — needs an"
        " asyncio event",
        "    loop (workloads 1,2,3,4,5,6,7,8 on trio)",
    ]
    assert max(len(line) for line in table) <= 100


def test_peers_missing_one_extra_share_one_line_of_the_comparison() -> None:
    [workload] = [w for w in WORKLOADS if w.key == "1"]
    runs = [
        Measurement(
            workload, "asyncio", Impl("asyncbus", "asyncbus", None), [Sample(0.01, 100, 100)]
        )
    ]
    runs += [
        row
        for impl in (FASTSTREAM, FASTSTREAM_RABBIT)
        for row in not_run(impl, "asyncio", NOT_INSTALLED)
    ]
    assert render_comparisons(runs, "asyncio").splitlines() == [
        "asyncbus / peer on workload 1 (asyncio; median of per-round ratios):",
        "  FastStream TestNatsBroker, FastStream TestRabbitBroker — n/a: not installed: faststream",
        "    (pip install -e '.[bench]')",
    ]


def test_without_a_checkout_python_m_asyncbus_bench_says_where_the_suite_is(
    tmp_path: Path,
) -> None:
    # The package as a wheel installs it: no benchmarks/ directory next to it.
    installed = tmp_path / "site-packages"
    source = Path(asyncbus.__file__).parent
    shutil.copytree(source, installed / "asyncbus", ignore=shutil.ignore_patterns("__pycache__"))
    for argv in (["--quick"], ["brokers"], ["rabbit", "--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "asyncbus", "bench", *argv],
            cwd=installed,  # `-m` puts the working directory first on the path
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert (done.returncode, done.stdout, done.stderr) == (2, "", NO_SUITE + "\n"), argv


@pytest.mark.bench
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loop", LOOPS)
def test_the_traced_rows_run_every_workload_and_report_their_cost(loop: str) -> None:
    from suite._report import render_tracing_cost

    impls = ("asyncbus", "otel", "otel-unsampled", "otel-sdk")
    plan = Plan(messages=200, requests=50, rounds=3, impls=impls, reruns=0)
    measurements = []
    for workload in WORKLOADS:
        measured = {m.impl.key: m for m in measure(workload, loop, plan)}
        for key in ("otel", "otel-unsampled", "otel-sdk"):
            assert measured[key].status == "ok", (workload.key, key, measured[key].reason)
            assert measured[key].bus_ratio is not None
        measurements += measured.values()
    table = render_tracing_cost(measurements).splitlines()
    assert table[0].startswith("OpenTelemetry tracing, by CPU time per message")
    rows = [line for line in table if line.startswith("  ") and "x (" in line]
    assert [row.split()[0] for row in rows] == [workload.key for workload in WORKLOADS]
    assert max(len(line) for line in table) <= 100


@pytest.mark.bench
def test_hot_path_costs_replaces_each_piece_of_a_publish_and_reports_it() -> None:
    # benchmarks/hot_path_costs.py swaps module globals of the publishing layer: when a
    # refactoring moves them, this fails instead of the script.
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    done = subprocess.run(
        [sys.executable, "hot_path_costs.py", "--messages", "300", "--rounds", "3"],
        cwd=benchmarks,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for variant in ("as it is", "id constant", "envelope constant", "receipt constant"):
        assert re.search(rf"^  {variant} +[\d.]+", done.stdout, re.M), done.stdout


def _scaling_results(free_threaded: bool, ft_wall_2: float, ft_overhead: float) -> tuple[Any, Any]:
    gil = {
        "walls": {"serial": 1.0, "thread/2": 1.0, "process/2": 0.55},
        "overhead_us": {"thread": 100.0, "process": 300.0},
    }
    free = {
        "free_threaded": free_threaded,
        "gil": "off" if free_threaded else "on",
        "walls": {"serial": 1.0, "thread/2": ft_wall_2},
        "overhead_us": {"thread": ft_overhead},
    }
    return gil, free


@pytest.mark.parametrize(
    ("free_threaded", "wall_2", "overhead", "passed", "fails"),
    [
        (True, 0.5, 140.0, True, 0),  # 2.0x serial; 1.4x the GIL build's overhead
        (True, 0.6, 140.0, False, 1),  # 1.67x serial
        (True, 0.5, 160.0, False, 1),  # 1.6x the GIL build's overhead
        (False, 0.5, 140.0, False, 1),  # not free-threaded at all
    ],
)
def test_the_cpu_scaling_check_judges_both_targets(
    free_threaded: bool,
    wall_2: float,
    overhead: float,
    passed: bool,
    fails: int,
    capsys: pytest.CaptureFixture[str],
) -> None:
    gil, free = _scaling_results(free_threaded, wall_2, overhead)
    assert cpu_stages.check_scaling(gil, free) is passed
    out = capsys.readouterr().out
    assert out.count("FAIL") == fails
    assert "INFO  GIL build, process offload, 2 workers: 1.82x serial" in out


def test_the_cpu_scaling_check_fails_without_a_free_threaded_interpreter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gil, _ = _scaling_results(True, 0.5, 100.0)
    assert cpu_stages.check_scaling(gil, None) is False
    assert "FAIL  no free-threaded interpreter was measured" in capsys.readouterr().out


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_the_cpu_scaling_run_measures_each_interpreter_in_a_process_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # This interpreter stands in for both builds: the table comes out, the check fails
    # (unless this interpreter is free-threaded and the machine fast enough).
    argv = ["--scaling", "--quick", "--repeats", "3", "--free-threaded", sys.executable]
    status = cpu_stages.main(argv)
    out = capsys.readouterr().out
    assert "interpreter" in out and "vs serial" in out and "overhead µs/msg" in out
    assert status == 0  # without --check, only reported
