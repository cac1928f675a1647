"""What the distributions hold: the wheel is the library alone; the sdist adds the rest.

Checked on the build configuration (pyproject.toml's hatch targets) and the files it
selects, without building: the test environment has no build backend and no network.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "asyncbus"


def targets() -> dict[str, Any]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    targets: dict[str, Any] = config["tool"]["hatch"]["build"]["targets"]
    return targets


def wheel_files() -> list[Path]:
    """The files hatchling puts in the wheel for ``packages = ["asyncbus"]``."""
    return sorted(
        path
        for path in PACKAGE.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    )


def test_the_wheel_is_the_asyncbus_package_and_nothing_else() -> None:
    wheel = targets()["wheel"]
    # Nothing but the package directory: no extra paths, no forced or shared files.
    assert wheel == {"packages": ["asyncbus"]}


def test_the_wheel_holds_no_benchmark_code() -> None:
    files = [path.relative_to(ROOT).as_posix() for path in wheel_files()]
    assert "asyncbus/__init__.py" in files
    assert [name for name in files if "bench" in name] == []
    assert not (PACKAGE / "_bench").exists()
    for path in wheel_files():
        if path.suffix != ".py":
            continue
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
        assert not imported & {"suite", "benchmarks"}, path


def test_the_sdist_holds_the_benchmarks() -> None:
    include = targets()["sdist"]["include"]
    assert {"asyncbus", "tests", "benchmarks", "README.md", "LICENSE"} <= set(include)
    assert (ROOT / "benchmarks" / "suite" / "__init__.py").is_file()
    assert (ROOT / "benchmarks" / "run.py").is_file()
