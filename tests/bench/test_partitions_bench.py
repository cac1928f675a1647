"""benchmarks/partitions.py: a short run over Redis keeps every key's order on one
replica at a time, nothing lost or handled twice (marked ``bench``: ``pytest -m
bench``); the default run checks its command line and its verdict."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def partitions() -> ModuleType:
    return importlib.import_module("partitions")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.bench
@pytest.mark.timeout(180)
def test_a_short_run_keeps_order_and_loses_nothing(
    partitions: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = partitions.main(["--messages", "600", "--keys", "40", "--rounds", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "partitioned" in out
    assert "lost" not in out and "twice" not in out and "disorder" not in out
    assert "ran on two replicas" not in out


def _figures(ratio: float, **faults: int) -> dict[str, Any]:
    base = {"rate": 1.0, "ratio_to_unordered": 1.0, "ratios": [1.0], "lost": 0, "twice": 0}
    base |= {"disorder": 0, "shared_keys": 0}
    return {
        "unordered": dict(base),
        "partitioned": base | {"ratio_to_unordered": ratio} | faults,
    }


def test_the_verdict_fails_below_the_target_and_on_any_fault(partitions: ModuleType) -> None:
    assert partitions.verdict(_figures(0.5)) == (True, [])
    ok, failures = partitions.verdict(_figures(0.3))
    assert not ok and "0.30x" in failures[0]
    for fault in ("lost", "twice", "disorder", "shared_keys"):
        ok, failures = partitions.verdict(_figures(0.9, **{fault: 2}))
        assert not ok and len(failures) == 1, fault


def test_help_runs(partitions: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        partitions.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
