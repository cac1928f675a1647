"""benchmarks/overload.py: a short run of each kind of configuration balances its ledger.

The short runs are marked ``bench`` (``pytest -m bench``); the default run checks the
recovery arithmetic and the command line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def overload() -> ModuleType:
    return importlib.import_module("overload")  # (benchmarks/ is on pytest's pythonpath)


@pytest.mark.bench
@pytest.mark.timeout(120)
def test_every_configuration_balances_its_ledger_on_a_short_run(overload: ModuleType) -> None:
    phases = [(0.5, 0.2), (3.0, 0.4), (0.5, 0.3)]
    for config in overload.configurations():
        result = overload.run("asyncio", overload.run_one, config, phases, 0.02, 0.5)
        assert result.ledger, (config.name, result.ledger_detail)
        assert result.offered == 40 + 480 + 60  # capacity 400/s: 0.5x, 3x, 0.5x


def test_recovery_is_the_end_of_the_last_abnormal_window(overload: ModuleType) -> None:
    due = [i * 0.01 for i in range(100)]  # one second, 10 per 100 ms window
    late = {i: 0.5 if i < 35 else 0.01 for i in range(100)}  # 0.0-0.35 s late, then normal
    done = [at + late[i] for i, at in enumerate(due)]
    assert overload._recovery(done, due, 0.0, 0.0, 1.0, 0.02) == pytest.approx(0.4)
    done[99] = -1.0  # the last one never handled: never recovered
    assert overload._recovery(done, due, 0.0, 0.0, 1.0, 0.02) is None


def test_help_runs(overload: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        overload.main(["--help"])
    assert exit_.value.code == 0
    assert "--check" in capsys.readouterr().out
