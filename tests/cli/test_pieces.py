"""The command line's parts, in process: its parser, its JSON log lines, its addresses."""

from __future__ import annotations

import json
import logging
import tomllib
from pathlib import Path

import pytest

from asyncbus.__main__ import COMMANDS, build_parser
from asyncbus._cli import Exit
from asyncbus._cli.admin import parse_address
from asyncbus._cli.logs import JsonFormatter

ROOT = Path(__file__).resolve().parents[2]


def test_run_parses_every_documented_option() -> None:
    arguments = build_parser().parse_args(
        [
            "run",
            "shop.worker:bus",
            "--workers",
            "4",
            "--graceful-timeout",
            "25",
            "--admin",
            "0.0.0.0:8080",
            "--metrics",
            "--loop",
            "uvloop",
            "--log-level",
            "warning",
            "--log-format",
            "json",
        ]
    )
    assert (arguments.command, arguments.target, arguments.workers) == ("run", "shop.worker:bus", 4)
    assert (arguments.graceful_timeout, arguments.admin, arguments.metrics) == (
        25.0,
        "0.0.0.0:8080",
        True,
    )
    assert (arguments.loop, arguments.log_level, arguments.log_format) == (
        "uvloop",
        "warning",
        "json",
    )


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
        (["--graceful-timeout", "-1"], "must be a finite number of seconds >= 0, got -1"),
        (["--admin", "8080"], "argument --admin: expected HOST:PORT, got '8080'"),
        (["--admin", "h:99999"], "the port of 'h:99999' is not from 0 to 65535"),
        (["--loop", "gevent"], "argument --loop: invalid choice: 'gevent'"),
    ],
)
def test_bad_run_options_exit_2(
    option: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["run", "m:bus", *option])
    assert exited.value.code == Exit.USAGE
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        (":9000", ("0.0.0.0", 9000)),
        ("[::1]:80", ("::1", 80)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_admin_addresses(text: str, address: tuple[str, int]) -> None:
    assert parse_address(text) == address


def test_json_log_lines_carry_the_extra_fields_and_the_traceback() -> None:
    logger = logging.getLogger("asyncbus.test_json")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        try:
            raise KeyError("k")
        except KeyError:
            logger.error(
                "failed %s", "here", exc_info=True, extra={"asyncbus_stage": "a@b", "odd": {1, 2}}
            )
    finally:
        logger.removeHandler(handler)
    line = JsonFormatter().format(records[0])
    assert "\n" not in line
    document = json.loads(line)
    assert document["message"] == "failed here"
    assert (document["level"], document["logger"]) == ("ERROR", "asyncbus.test_json")
    assert document["asyncbus_stage"] == "a@b" and sorted(document["odd"]) == [1, 2]
    assert document["exception"].endswith("KeyError: 'k'")
    assert document["time"].endswith("+00:00")


def test_the_command_table_and_the_console_script() -> None:
    assert list(COMMANDS) == ["run", "asyncapi", "groups", "demo", "bench"]
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert config["project"]["scripts"] == {"asyncbus": "asyncbus.__main__:main"}
    assert "watchfiles>=0.21" in config["project"]["optional-dependencies"]["reload"]
