"""``python -m asyncbus run`` as a user runs it: the forms of target, errors, the admin
port, the supervisor and the reloader (in memory; the broker runs are in
``test_run_redis.py``)."""

from __future__ import annotations

import re
import signal
import socket
import textwrap
from pathlib import Path

import httpx
import pytest
from _command import HERE, Running, run_command

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]


def target(name: str) -> tuple[str, ...]:
    return (f"_targets:{name}", "--app-dir", str(HERE))


@pytest.mark.parametrize(
    ("name", "bus_name"),
    [
        ("bus", "cli-test"),
        ("factory", "from-factory"),
        ("async_factory", "from-async-factory"),
        ("starlette_app", "in-starlette"),
        ("fastapi_app", "in-fastapi"),
    ],
)
async def test_every_form_of_target_runs_its_bus_until_sigterm_and_exits_0(
    name: str, bus_name: str
) -> None:
    async with run_command(*target(name)) as command:
        (running,) = await command.wait_for_event("running")
        assert f"running bus {bus_name!r} from _targets:{name}" in running["message"]
        assert await command.stop(signal.SIGTERM) == 0, command.text()
    report = command.report()
    assert report == {
        "drained": True,
        "published": 0,
        "completed": 0,
        "dead_lettered": 0,
        "abandoned": [],
    }


@pytest.mark.parametrize("loop", ["asyncio", "uvloop", "trio"])
async def test_the_loop_can_be_chosen(loop: str) -> None:
    async with run_command(*target("bus"), "--loop", loop) as command:
        await command.wait_for_event("running")
        assert await command.stop(signal.SIGINT) == 0, command.text()


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (("nowhere:bus",), "cannot import 'nowhere': No module named 'nowhere'"),
        (("_targets",), "'_targets' is not module:attribute"),
        (("_targets:missing",), "module '_targets' has no attribute 'missing'"),
        (("_targets:not_a_bus",), "_targets:not_a_bus is builtins.int 42, not a Bus"),
        (("_targets:needs_arguments",), "takes 2 argument(s): a factory takes none"),
        (("_targets:bus", "--metrics"), "--metrics is served on the admin port"),
        (("_targets:bus", "--reload-dir", "."), "--reload-dir is for --reload"),
        (("_targets:bus", "--admin", "127.0.0.1:1", "--loop", "trio"), "needs --loop asyncio"),
        (("_targets:bus", "--workers", "2", "--metrics"), "--metrics is served on the admin"),
    ],
)
async def test_what_cannot_run_exits_2_with_one_clear_line(
    arguments: tuple[str, ...], said: str
) -> None:
    async with run_command(*arguments, "--app-dir", str(HERE)) as command:
        assert await command.exit_code() == 2
    (error,) = command.matching(lambda r: r.get("level") == "ERROR")
    assert said in error["message"], error
    assert "exception" not in error  # no traceback: nothing of the user's code failed


async def test_a_module_that_raises_on_import_exits_2_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "broken.py").write_text("raise LookupError('no settings')\n")
    async with run_command("broken:bus", "--app-dir", str(tmp_path)) as command:
        assert await command.exit_code() == 2
    (error,) = command.matching(lambda r: r.get("level") == "ERROR")
    assert error["message"] == ("asyncbus run: importing 'broken' raised LookupError: no settings")
    assert 'broken.py", line 1' in error["exception"]


async def test_bad_arguments_exit_2_from_argparse() -> None:
    async with run_command("_targets:bus", "--graceful-timeout", "nan") as command:
        assert await command.exit_code() == 2
    assert "argument --graceful-timeout: must be a finite number of seconds >= 0, got nan" in (
        command.text()
    )


async def test_a_bus_that_cannot_start_exits_1() -> None:
    async with run_command(*target("broken_factory")) as command:
        assert await command.exit_code() == 1
    (error,) = command.matching(lambda r: r.get("level") == "ERROR")
    assert error["message"] == "the bus crashed: RuntimeError: the factory cannot make a bus"


async def test_a_handler_that_raises_system_exit_stops_the_bus_and_exits_1() -> None:
    async with run_command(*target("exiting_app")) as command:
        assert await command.exit_code() == 1, command.text()
    (error,) = command.matching(
        lambda r: r.get("logger") == "asyncbus.cli" and r["level"] == "ERROR"
    )
    assert error["message"] == "a handler raised SystemExit: the bus stopped at once"


def admin_url(command: Running) -> str:
    (line,) = command.matching(lambda r: "/healthz and /readyz on" in r.get("message", ""))
    match = re.search(r"on (http://\S+)$", line["message"])
    assert match is not None, line
    return match[1]


async def test_admin_serves_the_probes_and_readyz_fails_while_draining() -> None:
    arguments = (*target("busy_app"), "--admin", "127.0.0.1:0", "--graceful-timeout", "60")
    async with run_command(*arguments, env={"CLI_TEST_BLOCK": "1"}) as command:
        await command.wait_for_event("running")
        await command.wait_for(lambda r: r.get("cli_test") == "blocking")
        url = admin_url(command)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/healthz")).json() == {"status": "ok"}
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            stats = (await client.get("/stats")).json()
            assert [s["name"] for s in stats["stages"]] == ["jobs@workers"]

            command.send(signal.SIGTERM)  # the slow job holds the drain
            await command.wait_for(lambda r: "draining" in r.get("message", ""))
            ready = await client.get("/readyz")
            assert (ready.status_code, ready.json()["status"]) == (503, "not ready")
            alive = await client.get("/healthz")
            assert (alive.status_code, alive.json()) == (200, {"status": "closing"})
        assert await command.stop(signal.SIGTERM) == 3, command.text()  # forced
    assert len(command.report()["abandoned"]) == 1


async def test_with_workers_the_admin_port_is_served_by_worker_0() -> None:
    arguments = (*target("bus"), "--workers", "2", "--admin", "127.0.0.1:0")
    async with run_command(*arguments) as command:
        running = await command.wait_for_event("running", count=2)
        url = admin_url(command)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/readyz")).json() == {"status": "ready"}
        (served,) = command.matching(lambda r: "/healthz and /readyz on" in r.get("message", ""))
        (first,) = [r for r in running if r["asyncbus_worker"] == 0]
        assert served["pid"] == first["pid"]
        assert await command.stop(signal.SIGTERM) == 0, command.text()
    assert len([r for r in command.records if "asyncbus_report" in r]) == 2


async def test_the_supervisor_gives_up_on_workers_that_keep_crashing() -> None:
    arguments = (*target("broken_factory"), "--workers", "2", "--max-restarts", "2")
    async with run_command(*arguments) as command:
        assert await command.exit_code() == 1
    restarts = command.matching(lambda r: "restarting it in" in r.get("message", ""))
    assert len(restarts) == 2
    (gave_up,) = command.matching(lambda r: "giving up" in r.get("message", ""))
    assert gave_up["message"].startswith("asyncbus run: workers exited 3 times within 60s")


async def test_the_supervisor_stops_at_once_when_a_worker_cannot_load() -> None:
    async with run_command("_targets:missing", "--app-dir", str(HERE), "--workers", "2") as c:
        assert await c.exit_code() == 2
    assert c.matching(
        lambda r: re.search(r"worker [01] cannot load its target", r.get("message", ""))
    )
    assert not c.matching(lambda r: "restarting it in" in r.get("message", ""))


async def test_reload_restarts_the_workers_when_a_python_file_changes(tmp_path: Path) -> None:
    module = tmp_path / "service.py"

    def write(version: int) -> None:
        module.write_text(
            textwrap.dedent(
                f"""
                from asyncbus import Bus

                bus = Bus(name="version-{version}")
                """
            )
        )

    write(1)
    async with run_command("service:bus", "--app-dir", str(tmp_path), "--reload") as command:
        (first,) = await command.wait_for_event("running")
        assert "running bus 'version-1'" in first["message"]
        write(2)
        second = (await command.wait_for_event("running", count=2))[1]
        assert "running bus 'version-2'" in second["message"]
        assert second["pid"] != first["pid"]
        assert command.matching(lambda r: "service.py changed" in r.get("message", ""))
        assert await command.stop(signal.SIGTERM) == 0, command.text()


@pytest.mark.parametrize("workers", ["1", "2"])
async def test_an_admin_port_in_use_exits_2_before_the_bus_starts(workers: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        arguments = (*target("bus"), "--admin", f"127.0.0.1:{port}", "--workers", workers)
        async with run_command(*arguments) as command:
            assert await command.exit_code() == 2
    (error,) = command.matching(lambda r: r.get("level") == "ERROR")
    assert error["message"] == (
        f"asyncbus run: --admin cannot listen on 127.0.0.1:{port}: Address already in use"
    )
    assert not command.matching(lambda r: r.get("asyncbus_event") == "running")


async def test_reload_without_watchfiles_says_which_extra_to_install(tmp_path: Path) -> None:
    (tmp_path / "watchfiles.py").write_text("raise ImportError('No module named watchfiles')\n")
    arguments = (*target("bus"), "--reload")
    async with run_command(*arguments, env={"PYTHONPATH": str(tmp_path)}) as command:
        assert await command.exit_code() == 2
    (error,) = command.matching(lambda r: r.get("level") == "ERROR")
    assert error["message"] == (
        "asyncbus run: --reload needs watchfiles: pip install 'asyncbus[reload]'"
    )


async def test_a_sigterm_while_the_target_is_imported_never_starts_the_bus(
    tmp_path: Path,
) -> None:
    (tmp_path / "slow.py").write_text(
        textwrap.dedent(
            """
            import sys
            import time

            from asyncbus import Bus

            print("importing", file=sys.stderr, flush=True)
            time.sleep(1)
            bus = Bus()
            """
        )
    )
    async with run_command("slow:bus", "--app-dir", str(tmp_path)) as command:
        await command.wait_for(lambda r: r.get("raw") == "importing")
        assert await command.stop(signal.SIGTERM) == 0, command.text()
    assert command.matching(
        lambda r: r.get("message") == "SIGTERM before the bus started: not starting it"
    )
    assert not command.matching(lambda r: r.get("asyncbus_event") == "running")
