"""``python -m asyncbus demo|bench``, and ``--version``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from . import __version__

#: Said by ``bench`` where there is no checkout next to the package (an installed wheel).
NO_SUITE = """\
python -m asyncbus bench: the benchmark suite is not part of the installed package; it
lives in the benchmarks/ directory of the asyncbus source (a checkout, or the sdist).
From there:
    pip install -e '.[bench]'
    python -m asyncbus bench --quick    (the same as: python benchmarks/run.py --quick)
    python -m asyncbus bench brokers    (Redis Streams and NATS JetStream end to end)
    python -m asyncbus bench rabbit     (RabbitMQ end to end)
    python -m asyncbus bench cpu        (CPU-bound stages: thread and process offload)"""

#: The suite's module behind each ``bench`` subcommand; any other arguments go to ``suite``.
_BENCH_MODULES = {"brokers": "suite._brokers", "rabbit": "suite._rabbit", "cpu": "cpu_stages"}


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


def _bench(rest: list[str]) -> int:
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


def _int_in(low: int, high: int | None) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high`` (no bound when ``None``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"from {low} to {high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="python -m asyncbus")
    parser.add_argument("--version", action="version", version=f"asyncbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run an orders pipeline and print its statistics")
    demo.add_argument(
        "--orders",
        type=_int_in(1, None),
        default=2000,
        help="how many orders to publish (at least 1)",
    )
    demo.add_argument(
        "--serve", action="store_true", help="also serve the live admin dashboard on 127.0.0.1"
    )
    demo.add_argument(
        "--port",
        type=_int_in(0, 65535),
        default=8000,
        help="the dashboard's port, 0 to 65535 (0: any)",
    )
    commands.add_parser(
        "bench",
        help="run the benchmark suite of a checkout (see --help there); 'bench brokers' and "
        "'bench rabbit' run the broker end-to-end benchmarks, 'bench cpu' the CPU-bound "
        "stages (benchmarks/cpu_stages.py)",
        add_help=False,
    )
    arguments, rest = parser.parse_known_args(argv)
    if arguments.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    from functools import partial

    from ._demo import DemoError, run_demo
    from ._runtime import run

    try:
        run(partial(run_demo, arguments.orders, serve=arguments.serve, port=arguments.port))
    except DemoError as error:
        print(f"python -m asyncbus {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
