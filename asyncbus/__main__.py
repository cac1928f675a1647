"""``python -m asyncbus demo|bench``, and ``--version``."""

from __future__ import annotations

import argparse
import sys

from . import __version__


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command."""
    parser = argparse.ArgumentParser(prog="python -m asyncbus")
    parser.add_argument("--version", action="version", version=f"asyncbus {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run an orders pipeline and print its statistics")
    demo.add_argument("--orders", type=int, default=2000, help="how many orders to publish")
    demo.add_argument(
        "--serve", action="store_true", help="also serve the live admin dashboard on 127.0.0.1"
    )
    demo.add_argument("--port", type=int, default=8000, help="the dashboard's port (0: any)")
    commands.add_parser(
        "bench",
        help="run the benchmark suite (see --help there); 'bench brokers' and 'bench rabbit' "
        "run the broker end-to-end benchmarks",
        add_help=False,
    )
    arguments, rest = parser.parse_known_args(argv)
    if arguments.command == "bench":
        if rest[:1] == ["rabbit"]:  # RabbitMQ end to end vs a hand-written aio-pika loop
            from ._bench._rabbit import main as rabbit

            return rabbit(rest[1:])
        if rest[:1] == ["brokers"]:  # Redis and NATS end to end vs hand-written clients
            from ._bench._brokers import main as brokers

            return brokers(rest[1:])
        from ._bench import main as bench

        return bench(rest)
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
