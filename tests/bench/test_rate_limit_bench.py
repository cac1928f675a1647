"""benchmarks/rate_limit.py: a short run over Redis keeps the shared limit (marked
``bench``: ``pytest -m bench``); the default run checks its command line."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def rate_limit() -> ModuleType:
    return importlib.import_module("rate_limit")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.bench
@pytest.mark.timeout(120)
def test_a_short_run_keeps_the_shared_limit(
    rate_limit: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    code = rate_limit.main(["--rate", "100", "--processes", "2", "--seconds", "4", "--check"])
    assert "nothing handled twice: met" in capsys.readouterr().out
    assert code == 0


def test_help_runs(rate_limit: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        rate_limit.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
