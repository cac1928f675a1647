"""benchmarks/rate_limit.py: a short run over Redis keeps the shared limit (marked
``bench``: ``pytest -m bench``); the default run checks its command line."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "rate_limit.py"


@pytest.fixture(scope="module")
def rate_limit() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rate_limit", SCRIPT)  # (its workers import it)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
