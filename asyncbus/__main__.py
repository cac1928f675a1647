"""``python -m asyncbus run|asyncapi|groups|demo|bench``, and ``--version``."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from . import __version__
from ._cli import Command, int_in
from ._cli.asyncapi import COMMAND as ASYNCAPI
from ._cli.groups import COMMAND as GROUPS
from ._cli.run import COMMAND as RUN

#: Said by ``bench`` where there is no checkout next to the package (an installed wheel).
NO_SUITE = """\
python -m asyncbus bench: the benchmark suite is not part of the installed package; it
lives in the benchmarks/ directory of the asyncbus source (a checkout, or the sdist).
From there:
    pip install -e '.[bench]'
    python -m asyncbus bench --quick    (the same as: python benchmarks/run.py --quick)
    python -m asyncbus bench brokers    (Redis Streams and NATS JetStream end to end)
    python -m asyncbus bench rabbit     (RabbitMQ end to end)
    python -m asyncbus bench postgres   (PostgreSQL end to end)
    python -m asyncbus bench cpu        (CPU-bound stages: thread and process offload)
    python -m asyncbus bench scale      (one group shared by 1, 2 and 4 processes)
    python -m asyncbus bench fanout     (a publish to several groups: one Redis, a Cluster)"""

#: The suite's module behind each ``bench`` subcommand; any other arguments go to ``suite``.
_BENCH_MODULES = {
    "brokers": "suite._brokers",
    "rabbit": "suite._rabbit",
    "postgres": "suite._postgres",
    "cpu": "cpu_stages",
    "scale": "scale",
    "fanout": "cluster_fanout",
}


def _checkout_benchmarks() -> Path | None:
    """The ``benchmarks/`` directory of the checkout this package runs from, if any.

    Present when the package is imported from a checkout of the source (an editable
    install, or run from the source directory); an installed wheel has none.
    """
    root = Path(__file__).resolve().parent.parent
    home = root / "benchmarks"
    if (root / "pyproject.toml").is_file() and (home / "suite" / "__init__.py").is_file():
        return home
    return None


def _bench(arguments: argparse.Namespace, rest: list[str]) -> int:
    """Run the checkout's benchmark suite with ``rest``; without one, say where it is (2)."""
    home = _checkout_benchmarks()
    if home is None:
        print(NO_SUITE, file=sys.stderr)
        return 2
    if str(home) not in sys.path:
        sys.path.insert(0, str(home))
    module = _BENCH_MODULES.get(rest[0], "") if rest else ""
    if module:
        rest = rest[1:]
    suite = importlib.import_module(module or "suite")
    return int(suite.main(rest))


def _configure_demo(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--orders",
        type=int_in(1, None),
        default=2000,
        help="how many orders to publish (at least 1)",
    )
    demo.add_argument(
        "--serve", action="store_true", help="also serve the live admin dashboard on 127.0.0.1"
    )
    demo.add_argument(
        "--port",
        type=int_in(0, 65535),
        default=8000,
        help="the dashboard's port, 0 to 65535 (0: any)",
    )


def _demo(arguments: argparse.Namespace, rest: list[str]) -> int:
    from functools import partial

    from ._demo import DemoError, run_demo
    from ._runtime import run

    try:
        run(partial(run_demo, arguments.orders, serve=arguments.serve, port=arguments.port))
    except DemoError as error:
        print(f"python -m asyncbus {error}", file=sys.stderr)
        return 2
    return 0


#: The commands, by name. A new command is a module of ``asyncbus._cli`` exposing a
#: :class:`~asyncbus._cli.Command`, and one row here.
COMMANDS: dict[str, Command] = {
    "run": RUN,
    "asyncapi": ASYNCAPI,
    "groups": GROUPS,
    "demo": Command(
        help="run an orders pipeline and print its statistics",
        configure=_configure_demo,
        run=_demo,
    ),
    "bench": Command(
        help="run the benchmark suite of a checkout (see --help there); 'bench brokers', "
        "'bench rabbit' and 'bench postgres' run the broker end-to-end benchmarks, "
        "'bench cpu' the CPU-bound stages (benchmarks/cpu_stages.py)",
        configure=lambda parser: None,
        run=_bench,
        passthrough=True,
    ),
}


def build_parser(prog: str = "python -m asyncbus") -> argparse.ArgumentParser:
    """The command line's parser: one subparser per entry of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--version", action="version", version=f"asyncbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, add_help=not command.passthrough)
        command.configure(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command; return its exit status."""
    prog = "asyncbus" if Path(sys.argv[0]).name == "asyncbus" else "python -m asyncbus"
    parser = build_parser(prog)
    arguments, rest = parser.parse_known_args(argv)
    command = COMMANDS[arguments.command]
    if rest and not command.passthrough:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    return command.run(arguments, rest)


if __name__ == "__main__":
    sys.exit(main())
