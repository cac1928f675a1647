"""``python -m asyncbus asyncapi module:bus``: the document of a bus, from a shell."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncbus.__main__ import main
from asyncbus.asyncapi import document

APP = '''\
"""A shop's bus, for the command line's tests."""

from __future__ import annotations

import dataclasses

from asyncbus import Bus
from asyncbus.transports import RedisTransport


@dataclasses.dataclass
class Order:
    id: int


bus = Bus(transport=RedisTransport("redis://app:hunter2@127.0.0.1:6379/0"), name="shop")


@bus.subscribe("orders.created", group="mailer")
async def mail(order: Order) -> None:
    """Mail the confirmation."""


PUBLISHES = {"orders.shipped": Order}
NOT_A_BUS = 42


def make_bus() -> Bus:
    return bus
'''


@pytest.fixture
def app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a module holding ``APP``, importable from the current directory."""
    name = f"shop_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(APP)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield name
    finally:
        sys.modules.pop(name, None)


def command(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncbus", "asyncapi", *arguments],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def expected(app: str, **options: Any) -> dict[str, Any]:
    """The document of the app's bus, made in this process."""
    return document(importlib.import_module(app).bus, **options)


def test_prints_the_document_of_module_bus_as_json(app: str, tmp_path: Path) -> None:
    result = command(f"{app}:bus", "--title", "Shop", "--version", "2.0.1", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    spec = json.loads(result.stdout)
    assert spec == expected(app, title="Shop", version="2.0.1")
    assert spec["info"] == {"title": "Shop", "version": "2.0.1"}
    assert list(spec["operations"]) == ["receive-orders.created-mailer"]
    assert spec["servers"]["redis"]["host"] == "127.0.0.1:6379"
    assert "hunter2" not in result.stdout


def test_writes_yaml_to_a_file(app: str, tmp_path: Path) -> None:
    yaml = pytest.importorskip("yaml")
    out = tmp_path / "asyncapi.yaml"
    result = command(
        f"{app}:bus",
        "--publications",
        f"{app}:PUBLISHES",
        "--format",
        "yaml",
        "--output",
        str(out),
        cwd=tmp_path,
    )
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    text = out.read_text(encoding="utf-8")
    assert text.startswith("asyncapi: 3.0.0\n")
    module = importlib.import_module(app)
    assert yaml.safe_load(text) == expected(app, publications=module.PUBLISHES)
    # Written out in full: no YAML anchors and aliases for what repeats.
    assert text.count("$ref: '#/components/schemas/EnvelopeHeaders'") == 2
    assert "&id" not in text and "*id" not in text


def test_a_function_may_make_the_bus_and_publications_name_a_mapping(
    app: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["asyncapi", f"{app}:make_bus", "--publications", f"{app}:PUBLISHES"]) == 0
    spec = json.loads(capsys.readouterr().out)
    module = importlib.import_module(app)
    assert spec == document(module.bus, publications=module.PUBLISHES)
    assert list(spec["operations"]) == ["receive-orders.created-mailer", "send-orders.shipped"]


def test_without_pyyaml_yaml_is_refused_with_what_to_install(
    app: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # import yaml raises ImportError
    assert main(["asyncapi", f"{app}:bus", "--format", "yaml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "python -m asyncbus asyncapi: --format yaml needs PyYAML: pip install pyyaml\n"
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            ["{app}"],
            "'{app}' is not module:attribute (for example 'shop.workers:bus', with "
            "shop/workers.py defining bus = Bus(...))",
        ),
        (
            ["{app}:"],
            "'{app}:' is not module:attribute (for example 'shop.workers:bus', with "
            "shop/workers.py defining bus = Bus(...))",
        ),
        (["{app}:nothing"], "module '{app}' has no attribute 'nothing'"),
        (["{app}:NOT_A_BUS"], "'{app}:NOT_A_BUS' is a int, not an asyncbus Bus"),
        (["{app}:Order"], "'{app}:Order' is a type, not an asyncbus Bus"),
        (
            ["{app}:bus", "--publications", "{app}:NOT_A_BUS"],
            "'{app}:NOT_A_BUS' is a int, not a mapping of topics to payload types",
        ),
        (["{app}:bus", "--version", ""], "document: version must be a non-empty string, got ''"),
    ],
)
def test_what_names_no_bus_is_an_error_on_stderr_with_status_2(
    app: str, capsys: pytest.CaptureFixture[str], arguments: list[str], message: str
) -> None:
    given = [argument.format(app=app) for argument in arguments]
    assert main(["asyncapi", *given]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"python -m asyncbus asyncapi: {message.format(app=app)}\n"


def test_an_error_inside_the_module_is_not_taken_for_a_missing_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    name = f"broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["asyncapi", f"{name}:bus"]) == 2
    error = capsys.readouterr().err
    assert f"importing {name!r} failed" in error and "no_such_dependency_here" in error, error
    sys.modules.pop(name, None)


def test_a_module_that_does_not_exist_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["asyncapi", "no_such_module_here:bus"]) == 2
    error = capsys.readouterr().err
    assert error.startswith(
        "python -m asyncbus asyncapi: cannot import 'no_such_module_here': "
        "No module named 'no_such_module_here'"
    ), error


def test_the_documents_of_the_examples_come_from_the_command(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "work_queue.json"
    result = command("examples.work_queue:bus", "-o", str(out), cwd=root)
    assert (result.returncode, result.stderr) == (0, "")
    spec = json.loads(out.read_text(encoding="utf-8"))
    assert spec["info"]["title"] == "asyncbus"
    assert sorted(spec["operations"]) == [
        "receive-images.uploaded-audit",
        "receive-images.uploaded-resizers",
    ]
