"""benchmarks/scheduling.py: a short run in memory publishes every scheduled envelope
once, on time, and its command line checks the target (a second in the default run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduling.py"


@pytest.fixture(scope="module")
def scheduling() -> ModuleType:
    spec = importlib.util.spec_from_file_location("scheduling_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
