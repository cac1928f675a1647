"""benchmarks/retry_paths.py: a tiny run over Redis measures the three retry paths and
accounts for every envelope (marked ``bench``: ``pytest -m bench``); the default run
checks its command line."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def retry_paths() -> ModuleType:
    return importlib.import_module("retry_paths")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.bench
@pytest.mark.timeout(120)
def test_a_tiny_run_over_redis_handles_each_envelope_twice_and_acks_it_once(
    retry_paths: ModuleType, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    arguments = ["--brokers", "redis", "--envelopes", "20", "--delay", "0.05"]
    arguments += ["--rounds", "1", "--quiet", "0.1", "--json", str(out), "--check"]
    assert retry_paths.main(arguments) == 0
    assert "every envelope handled twice and acked once: yes" in capsys.readouterr().out
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"redis"}
    for path, row in figures["redis"].items():
        assert (row["lost"], row["duplicated"]) == (0, 0), path
        assert row["delay_p50"] >= 0.049, path  # not early
        assert row["time"] >= 0.05, path


def test_help_runs(retry_paths: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        retry_paths.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
