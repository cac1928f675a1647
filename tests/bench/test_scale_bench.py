"""benchmarks/scale.py: a short run over the local Redis with one and two worker
processes accounts for every envelope and prints the table with its ratios."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    return importlib.import_module("scale")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.timeout(180)
def test_a_short_run_shares_the_group_and_loses_nothing(
    scale: ModuleType, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    arguments = ["--brokers", "redis", "--redis", redis_url, "--messages", "2000"]
    code = scale.main([*arguments, "--processes", "1,2", "--json", str(out), "--check"])
    results = json.loads(out.read_text())
    assert code == 0
    assert [(r["broker"], r["processes"]) for r in results] == [("redis", 1), ("redis", 2)]
    for result in results:
        assert (result["lost"], result["twice"]) == (0, 0)
        assert sum(result["per_process"]) == 2000
    printed = capsys.readouterr().out
    assert "| redis | one node | 1 |" in printed and "1.00x" in printed


def test_help_runs(scale: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        scale.main(["--help"])
    assert exit_.value.code == 0
    assert "--nats-cluster" in capsys.readouterr().out
