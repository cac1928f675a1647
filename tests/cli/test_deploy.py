"""examples/deploy: its command lines are valid ``asyncbus run`` invocations, its probes
exist, its deadlines agree, and the worker it deploys runs."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from _command import run_command

from asyncbus import Bus
from asyncbus.__main__ import build_parser
from asyncbus.integrations.starlette import admin_app
from asyncbus.transports import RedisTransport

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"


def parse_run(argv: list[str]) -> Any:
    """``argv`` (``asyncbus run ...`` or ``python -m asyncbus run ...``) parsed by the
    command's own parser."""
    if argv[:3] == ["python", "-m", "asyncbus"]:
        rest = argv[3:]
    else:
        assert Path(argv[0]).name == "asyncbus", argv
        rest = argv[1:]
    arguments = build_parser().parse_args(rest)  # exits 2 on a bad option
    assert arguments.command == "run"
    return arguments


def manifest() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((DEPLOY / "kubernetes.yaml").read_text(encoding="utf-8")))


def of_kind(kind: str) -> dict[str, Any]:
    (document,) = [d for d in manifest() if d["kind"] == kind]
    return document


def dockerfile_command() -> list[str]:
    (line,) = [
        line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("CMD")
    ]
    command: list[str] = json.loads(line.removeprefix("CMD"))  # the exec form
    return command


def deployed_bus() -> Bus:
    """The bus of examples/deploy/worker.py (made, not started)."""
    spec = importlib.util.spec_from_file_location("deployed_worker", DEPLOY / "worker.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    bus: Bus = module.bus
    return bus


def admin_paths() -> set[str]:
    return {route.path for route in admin_app(Bus()).routes}  # type: ignore[attr-defined]


def test_the_kubernetes_deployment_probes_the_admin_app_within_its_drain_deadline() -> None:
    pod = of_kind("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    arguments = parse_run([*container.get("command", []), *container.get("args", [])])
    assert arguments.target == "worker:bus" and arguments.workers == 1
    admin_port = int(arguments.admin.rpartition(":")[2])
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    for probe, path in [
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/healthz"),
        ("startupProbe", "/healthz"),
    ]:
        get = container[probe]["httpGet"]
        assert get["path"] == path and path in admin_paths()
        assert ports[get["port"]] == admin_port
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    assert pod["terminationGracePeriodSeconds"] > arguments.graceful_timeout + pre_stop


def test_the_autoscaler_reads_the_saturation_of_a_stage_the_worker_has() -> None:
    (trigger,) = of_kind("ScaledObject")["spec"]["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("metrics-api", "Value")
    url = trigger["metadata"]["url"]
    service = of_kind("Service")
    port = service["spec"]["ports"][0]["port"]
    assert url == f"http://{service['metadata']['name']}.default.svc:{port}/stats"
    assert "/stats" in admin_paths()
    match = re.fullmatch(
        r'stages\.#\(name=="(.+)"\)\.saturation', trigger["metadata"]["valueLocation"]
    )
    assert match is not None
    bus = deployed_bus()
    assert match[1] in {stage.name for stage in bus.statistics().stages}
    assert isinstance(bus.statistics().stages[0].saturation, float)


def test_the_dockerfile_and_the_systemd_unit_run_valid_commands() -> None:
    docker = parse_run(dockerfile_command())
    assert (docker.target, docker.admin) == ("worker:bus", "0.0.0.0:8081")
    unit = (DEPLOY / "orders-worker.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", unit, re.MULTILINE)
    service = parse_run(shlex.split(exec_start))
    assert service.workers == 4
    (stop_seconds,) = re.findall(r"^TimeoutStopSec=(\d+)$", unit, re.MULTILINE)
    assert int(stop_seconds) > service.graceful_timeout
    assert re.search(r"^KillMode=mixed$", unit, re.MULTILINE)  # one signal per worker


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_deployed_worker_runs_serves_its_probes_and_drains(
    redis_url: str, redis_prefix: str
) -> None:
    arguments = parse_run(dockerfile_command())
    argv = [arguments.target, "--graceful-timeout", str(arguments.graceful_timeout)]
    env = {"REDIS_URL": redis_url, "ORDERS_PREFIX": redis_prefix}
    async with run_command(*argv, "--admin", "127.0.0.1:0", env=env, cwd=DEPLOY) as command:
        await command.wait_for_event("running")
        (line,) = command.matching(lambda r: "/healthz and /readyz on" in r.get("message", ""))
        url = line["message"].rpartition(" ")[2]
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            assert (await client.get("/readyz")).json() == {"status": "ready"}
            assert (await client.get("/healthz")).json() == {"status": "ok"}
        async with Bus(transport=RedisTransport(redis_url, prefix=redis_prefix)) as publisher:
            receipt = await publisher.publish("orders.created", {"id": 7})
        assert receipt.accepted == ("orders.created@fulfilment",)
        await command.wait_for(lambda r: r.get("message") == "fulfilled order 7")
        assert await command.stop(signal.SIGTERM) == 0, command.text()
    assert command.report()["completed"] == 1


def test_the_readme_and_the_guide_show_valid_commands() -> None:
    readme = (DEPLOY.parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.partition("## Running it in production\n")[2].partition("\n## ")[0]
    commands = [line for line in section.splitlines() if line.startswith("asyncbus run ")]
    assert len(commands) == 1
    for line in commands:
        arguments = parse_run(shlex.split(line))
        assert (arguments.admin, arguments.graceful_timeout) == ("0.0.0.0:8081", 25.0)
    guide = (DEPLOY.parents[1] / "docs" / "guide.md").read_text(encoding="utf-8")
    usage = guide.partition("### The worker command\n")[2].partition("```\n\n")[0]
    documented = set(re.findall(r"--[a-z-]+", usage))
    run_parser = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    offered = {
        option
        for action in run_parser._actions
        if action.help != "==SUPPRESS==" and action.option_strings
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert documented == offered
