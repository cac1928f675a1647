"""benchmarks/scheduling.py: a short run in memory publishes every scheduled envelope
once, on time, and its command line checks the target (a second in the default run)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def scheduling() -> ModuleType:
    return importlib.import_module("scheduling")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.timeout(60)
def test_a_short_run_publishes_each_scheduled_envelope_once(
    scheduling: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    arguments = ["--transports", "memory", "--rate", "200", "--seconds", "0.5"]
    arguments += ["--delay", "0.3", "--rounds", "1", "--json", str(out), "--check"]
    assert scheduling.main(arguments) == 0
    printed = capsys.readouterr().out
    assert "target: p99 <= 100 ms, nothing lost or duplicated: met" in printed
    results = json.loads(out.read_text())
    assert set(results) == {"baseline", "memory"}
    assert (results["memory"]["lost"], results["memory"]["duplicated"]) == (0, 0)


def test_help_runs(scheduling: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        scheduling.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
