"""The package's import graph: dependencies one way only, and no import hidden in a function.

The graph is built from the source (``ast``): every ``import`` and ``from ... import``
of an ``asyncbus`` module counts, at module level, inside functions and under
``TYPE_CHECKING`` alike, and importing ``a.b.c`` also imports the package ``a.b``.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import asyncbus

PACKAGE = pathlib.Path(asyncbus.__file__).parent

#: Modules outside the core: the command line, the demo, the benchmark suite and the
#: integrations may import lazily (what they import needs extras, or is slow to load).
OUTSIDE_THE_CORE = (
    "asyncbus.__main__",
    "asyncbus._cli",
    "asyncbus._demo",
    "asyncbus._bench",
    "asyncbus.integrations",
)

#: Modules that need an optional extra (a broker client, a web framework, tracing):
#: the core may import these lazily, inside a function, and nothing else.
OPTIONAL_EXTRAS = (
    "asyncbus.integrations",
    "asyncbus.transports.redis",
    "asyncbus.transports.nats",
    "asyncbus.transports.rabbit",
    "asyncbus._bench",
)

#: The broker transports' own modules (their internal layering is checked apart).
BROKER_MODULES = (
    "asyncbus.transports._nats",
    "asyncbus.transports._pg",
    "asyncbus.transports._rabbit",
    "asyncbus.transports._redis",
    "asyncbus.transports.nats",
    "asyncbus.transports.postgres",
    "asyncbus.transports.rabbit",
    "asyncbus.transports.redis",
)


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["asyncbus", *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix) for prefix in prefixes)


def _imports(module: str, path: pathlib.Path) -> Iterator[tuple[str, bool]]:
    """``(imported asyncbus module, inside a function)`` for each import in ``module``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.update(id(inner) for inner in ast.walk(node) if inner is not node)
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                name = ".".join([*base, *([node.module] if node.module else [])])
            else:
                name = node.module or ""
            submodules = [f"{name}.{a.name}" for a in node.names if f"{name}.{a.name}" in MODULES]
            targets += submodules
            if len(submodules) < len(node.names):
                targets.append(name)
        elif isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        for target in targets:
            if target in MODULES and target != module:
                yield target, id(node) in inside


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for module, path in MODULES.items():
        for target, _ in _imports(module, path):
            graph[module].add(target)
            # Importing a.b.c runs a.b first; not a new dependency for a module of a.b
            # (its package is being imported already), nor for the root package.
            parent = target.rpartition(".")[0]
            while parent and parent != "asyncbus" and not f"{module}.".startswith(f"{parent}."):
                graph[module].add(parent)
                parent = parent.rpartition(".")[0]
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_core_has_no_import_cycle() -> None:
    graph = _graph()
    core = {
        module: {target for target in targets if not _within(target, BROKER_MODULES)}
        for module, targets in graph.items()
        if not _within(module, BROKER_MODULES)
    }
    assert _cycles(core) == []


def test_the_broker_transports_have_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_the_core_imports_nothing_of_asyncbus_inside_a_function() -> None:
    lazy = [
        f"{module} imports {target}"
        for module, path in MODULES.items()
        if not _within(module, OUTSIDE_THE_CORE)
        for target, in_function in _imports(module, path)
        if in_function and not _within(target, OPTIONAL_EXTRAS)
    ]
    assert lazy == []


def test_the_message_path_depends_one_way() -> None:
    """Vocabulary ← envelope ← middleware ← chain ← stage/consumer ← modes ← replies ←
    dead letters ← Bus."""
    graph = _graph()

    def reaches(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    layers = [
        "asyncbus._bus",
        "asyncbus._publishing",
        "asyncbus._dead_lettering",
        "asyncbus._replies",
        "asyncbus._modes",
        "asyncbus._consumer",
        "asyncbus._delivering",
        "asyncbus._stage",
        "asyncbus._chain",
        "asyncbus.middleware",
        "asyncbus._verdicts",
        "asyncbus._envelope",
    ]
    for lower_index, lower in enumerate(layers):
        below = reaches(lower)
        for higher in layers[:lower_index]:
            assert higher not in below, f"{lower} depends on {higher}"


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = _graph()
    assert "asyncbus._envelope" in graph["asyncbus._verdicts"] or (
        "asyncbus._dead_letters" in graph["asyncbus._verdicts"]
    )
    assert "asyncbus.middleware" in graph["asyncbus._chain"]  # via a.b.c: the package a.b
    assert graph["asyncbus._envelope"] == set()


#: The bus and the parts it hands its work to.
BUS_MODULES = (
    "_bus.py",
    "_lifecycle.py",
    "_subscribing.py",
    "_draining.py",
    "_services.py",
    "_snapshots.py",
)


def test_the_bus_never_asks_which_mode_it_runs_in() -> None:
    """In memory or over a broker is chosen once (``_modes``): ``_bus`` and its parts have
    no branch on it, not even on what its mode can do (the inline publish is
    ``_publishing``'s)."""
    tree = ast.Module(
        body=[
            node
            for module in BUS_MODULES
            for node in ast.parse((PACKAGE / module).read_text(encoding="utf-8")).body
        ],
        type_ignores=[],
    )
    attributes = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }
    assert not {"_broker", "direct"} & attributes
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.BoolOp | ast.Compare):
            mentioned = {
                inner.attr for inner in ast.walk(node) if isinstance(inner, ast.Attribute)
            } | {inner.id for inner in ast.walk(node) if isinstance(inner, ast.Name)}
            assert not {"transport", "broker"} & mentioned, ast.unparse(node)[:120]
    # The mode is asked to act (``await self._mode.backlog(...)``), never what it can do:
    # no condition reads one of its attributes (``self._mode.admits_inline``) as a value.
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            conditions: list[ast.AST] = [node.test]
        elif isinstance(node, ast.BoolOp | ast.Compare):
            conditions = [node]
        else:
            continue
        for condition in conditions:
            called = {
                id(inner.func) for inner in ast.walk(condition) if isinstance(inner, ast.Call)
            }
            for inner in ast.walk(condition):
                if (
                    isinstance(inner, ast.Attribute)
                    and isinstance(inner.value, ast.Attribute)
                    and inner.value.attr == "_mode"
                    and id(inner) not in called
                ):
                    raise AssertionError(f"reads the mode: {ast.unparse(condition)[:120]}")
