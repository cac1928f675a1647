"""benchmarks/ordering.py: a short run keeps every key's order, runs the hot key one at a
time, and its command line judges the throughput target (a second in the default run)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def ordering() -> ModuleType:
    return importlib.import_module("ordering")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.timeout(120)
def test_a_short_run_keeps_order_and_judges_the_target(
    ordering: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    arguments = ["--messages", "600", "--keys", "50", "--concurrency", "8", "--rounds", "1"]
    code = ordering.main([*arguments, "--json", str(out), "--check"])
    results = json.loads(out.read_text())
    assert set(results) == {"raw", "unordered", "ordered", "hot key"}
    for name in ("unordered", "ordered", "hot key"):
        assert results[name]["lost"] == 0, name
    assert (results["ordered"]["disorder"], results["hot key"]["disorder"]) == (0, 0)
    assert results["hot key"]["most_at_once"] == 1
    # A tiny run on a busy machine may miss the ratio: the exit status says exactly that.
    missed = results["ordered"]["ratio_to_unordered"] < ordering.TARGET
    assert code == (1 if missed else 0)
    printed = capsys.readouterr().out
    assert ("MISSED" in printed) == missed


def test_help_runs(ordering: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        ordering.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
