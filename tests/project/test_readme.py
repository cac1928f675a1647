"""Every ```python block of README.md runs as written, and does what the text says.

Blocks are found by the section they sit in. A script block runs in a subprocess as
``python block.py``; the broker block runs once per local broker (Redis, NATS,
RabbitMQ) with its ``prefix`` made unique to the run, and everything it declared is
deleted afterwards; the FastAPI block is imported and driven through httpx's ASGI
transport with its lifespan; the testing block is a pytest file, run by pytest the way
a user runs it, and run again against a failing handler and a mistyped topic to show
that it then fails. A block in any other section must run as a script and exit 0; so must every
```python block of docs/guide.md (signatures there are ```text).
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"

# Each block runs as written, in a subprocess (pytest -m readme runs these alone).
pytestmark = pytest.mark.readme


def python_blocks(path: Path = README) -> list[tuple[str, str]]:
    """``(section heading, code)`` of every ```python block of ``path``, in order."""
    blocks: list[tuple[str, str]] = []
    section = ""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.rstrip() == "```python":
            end = lines.index("```\n", index + 1)
            blocks.append((section, "".join(lines[index + 1 : end])))
            index = end
        index += 1
    return blocks


BLOCKS = python_blocks()


def block(section: str) -> str:
    """The one python block of ``section``."""
    [code] = [code for heading, code in BLOCKS if heading == section]
    return code


def run_script(path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path), *args],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# -- the blocks ----------------------------------------------------------------------


def check_quick_start(code: str, tmp_path: Path) -> None:
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    result = run_script(script)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout.splitlines()
    accepted = "accepted by ('orders.created@__main__:audit', 'orders.*@mailer')"
    assert out.count(accepted) == 3, result.stdout
    for order_id in (1, 2, 13):
        assert f"audit {{'id': {order_id}}}" in out
    for order_id in (1, 2):
        assert f"mail orders.created {{'id': {order_id}}} attempt 1" in out
    assert out[-3:] == [
        "orders.created@__main__:audit published 3 acked 3 dead-lettered 0",
        "orders.*@mailer published 3 acked 2 dead-lettered 1",
        "dead letter: {'id': 13} RuntimeError: unlucky order attempts 3",
    ]
    # The failure is logged (Python prints an unconfigured library's warnings to stderr).
    assert re.match(
        r"dead-lettered handler_failed: envelope \w+ on topic 'orders\.created' in stage "
        r"'orders\.\*@mailer' after 3 attempt\(s\): RuntimeError: unlucky order\n"
        r"Traceback \(most recent call last\):\n",
        result.stderr,
    ), result.stderr
    assert result.stderr.rstrip().endswith("RuntimeError: unlucky order")


def check_testing_example(code: str, tmp_path: Path) -> None:
    def pytest_run(source: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "test_orders.py").write_text(source)
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_orders.py"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    passed = pytest_run(code)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    # anyio's plugin runs it on every backend installed: asyncio and trio here.
    assert re.search(r"^2 passed in ", passed.stdout, re.MULTILINE), passed.stdout

    published = '{"id": 1, "email": "ann@example.com"}'
    assert code.count(published) == 1
    # The same test fails when the handler fails ...
    failing = pytest_run(code.replace(published, '{"id": 1}'))
    assert failing.returncode == 1, failing.stdout
    assert "2 failed in " in failing.stdout
    assert "assert bus.dead_letters.list() == []" in failing.stdout
    assert "ValueError: order 1 has no e-mail address" in failing.stdout

    # ... and when nothing takes what it publishes (a mistyped topic).
    mistyped = pytest_run(code.replace('publish("orders.created"', 'publish("order.created"'))
    assert mistyped.returncode == 1, mistyped.stdout
    assert "2 failed in " in mistyped.stdout
    assert "assert () == ('orders.created@mailer',)" in mistyped.stdout


def import_block(code: str, tmp_path: Path, name: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def check_fastapi_app(code: str, tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    name = f"readme_app_{uuid.uuid4().hex[:8]}"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ADMIN_TOKEN", "readme-token")
        module = import_block(code, tmp_path, name)
    try:
        app, bus = module.app, module.bus
        admin = {"Authorization": "Bearer readme-token"}

        async def drive() -> None:
            transport = httpx.ASGITransport(app=app)
            with anyio.fail_after(20):
                async with (
                    app.router.lifespan_context(app),
                    httpx.AsyncClient(transport=transport, base_url="http://app") as client,
                ):
                    response = await client.post("/orders", json={"id": 7})
                    assert response.status_code == 202
                    assert response.json()["stages"] == ["orders.created@mailer"]
                    await bus.drain(timeout=5)
                    assert (await client.get("/admin/stats")).status_code == 401
                    stats = (await client.get("/admin/stats", headers=admin)).json()
                    assert [(s["name"], s["published"], s["acked"]) for s in stats["stages"]] == [
                        ("orders.created@mailer", 1, 1)
                    ]
                    dead = (await client.get("/admin/dead-letters", headers=admin)).json()
                    assert dead["total"] == 0
                    page = await client.get("/admin/?token=readme-token")
                    assert page.status_code == 200
                    assert "text/html" in page.headers["content-type"]
            assert not bus.running

        anyio.run(drive)
    finally:
        sys.modules.pop(name, None)


# The suite's table of brokers (tests/transports/_brokers.py): names, ports, clean-up.
if str(ROOT / "tests" / "transports") not in sys.path:
    sys.path.append(str(ROOT / "tests" / "transports"))
brokers = importlib.import_module("_brokers")


async def delete_broker_state(broker: str, prefix: str) -> None:
    """Remove everything the broker block declared under ``prefix``."""
    await brokers.forget(broker, brokers.BROKERS[broker].url(), prefix)


def skip_without_clients(modules: list[str] | tuple[str, ...]) -> None:
    """Skip, naming them, when client libraries a block needs are not installed: only on
    an interpreter they have no build for (asyncpg on free-threaded 3.13t), whose CI job
    leaves them out; the main job has every one of them."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"not installed on this interpreter: {', '.join(missing)}")


def check_scaling_out(
    code: str, tmp_path: Path, broker: str, require_service: Callable[[str, int], None]
) -> None:
    skip_without_clients(brokers.BROKERS[broker].client_modules)
    require_service(brokers.BROKERS[broker].title, brokers.BROKERS[broker].port)
    prefix = f"readme-{uuid.uuid4().hex[:8]}"
    assert (code.count('prefix="shop"'), code.count('schema="shop"')) == (3, 1)
    script = tmp_path / "shop.py"
    schema = brokers.BROKERS["postgres"].namespaced(prefix)
    script.write_text(
        code.replace('prefix="shop"', f'prefix="{prefix}"').replace(
            'schema="shop"', f'schema="{schema}"'
        )
    )
    try:
        result = run_script(script, broker, timeout=90)
    finally:
        anyio.run(delete_broker_state, broker, prefix, backend="asyncio")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stdout.splitlines()) == [f"fulfilled order {n}" for n in range(3)]


def check_batches(code: str, tmp_path: Path) -> None:
    script = tmp_path / "batches.py"
    script.write_text(code)
    result = run_script(script)
    assert result.returncode == 0, result.stdout + result.stderr
    # 120 queued at once: calls of max_size, then the rest; the row without an id dies.
    assert result.stdout.splitlines() == ["119 rows in calls of [50, 50, 20]; 1 dead letter"]


# -- the tests -----------------------------------------------------------------------

#: Sections whose block gets more than "it runs": what it prints or does is checked.
CHECKED = {
    "Quick start": check_quick_start,
    "Testing your handlers": check_testing_example,
    "In a FastAPI or Starlette app": check_fastapi_app,
    "Batches": check_batches,
}
BROKER_SECTION = "Scaling out over a broker"


def check_script(code: str, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(code)
    result = run_script(script)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checked_sections_are_in_the_readme() -> None:
    # A renamed heading must not quietly turn a checked block into a plain run.
    sections = [heading for heading, _ in BLOCKS]
    for section in [*CHECKED, BROKER_SECTION]:
        assert sections.count(section) == 1, section


@pytest.mark.timeout(180)
@pytest.mark.parametrize("section", [heading for heading, _ in BLOCKS if heading != BROKER_SECTION])
def test_a_readme_block_runs_as_written(section: str, tmp_path: Path) -> None:
    CHECKED.get(section, check_script)(block(section), tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broker", brokers.names())
def test_the_readme_broker_block_runs_on_each_broker(
    broker: str, tmp_path: Path, require_service: Callable[[str, int], None]
) -> None:
    check_scaling_out(block(BROKER_SECTION), tmp_path, broker, require_service)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("section", [heading for heading, _ in python_blocks(GUIDE)])
def test_a_guide_block_runs_as_written(section: str, tmp_path: Path) -> None:
    [code] = [code for heading, code in python_blocks(GUIDE) if heading == section]
    clients = re.findall(r"^(?:import|from) (asyncpg|sqlalchemy)\b", code, flags=re.MULTILINE)
    if "sqlalchemy" in clients:
        clients.append("greenlet")  # (its asyncio engine's)
    skip_without_clients(clients)
    check_script(code, tmp_path)


# -- the test step of the set-up ------------------------------------------------------


def _setup_bash_blocks() -> list[str]:
    """Every ```bash block under "## Set-up", in order (as .ci/run reads the first)."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Set-up\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```bash\n(.*?)^```$", section, flags=re.MULTILINE | re.DOTALL)


def test_the_setup_names_the_full_run_and_a_quick_subset_with_their_durations() -> None:
    demo, full, quick = _setup_bash_blocks()
    # .ci/run runs the first block as a new user's first command: it stays the demo.
    assert demo == "pip install -e . && python -m asyncbus demo\n"
    assert full == "pip install -e '.[test]' && pytest\n"
    assert quick.startswith("pytest ")
    text = README.read_text(encoding="utf-8")
    assert "takes about twenty minutes" in text
    assert "takes about two\nminutes" in text
    # The quick subset is what it says: the in-memory core, on asyncio, without brokers.
    # Collecting it imports every core test module, so it needs the whole test extra
    # (msgspec is not installable on a free-threaded 3.13 build, whose CI job lacks it).
    if importlib.util.find_spec("msgspec") is None:
        pytest.skip("collecting the quick subset needs the test extra's msgspec")
    command = [sys.executable, "-m", *shlex.split(quick), "--collect-only", "-q"]
    collected = subprocess.run(
        [*command, "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    ids = [line for line in collected.splitlines() if "::" in line]
    assert 1_000 <= len(ids) <= 1_600, len(ids)  # "about 1,300 tests"
    assert not [i for i in ids if i.startswith(("tests/transports/", "tests/integrations/"))]
    assert not [i for i in ids if "[trio" in i or "[uvloop" in i]
