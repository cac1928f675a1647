"""``python -m asyncbus bench`` / ``python benchmarks/run.py``: parse, run, report, judge."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._memory import MemoryReport, measure_memory
from ._model import Measurement
from ._report import (
    check_targets,
    machine,
    print_out,
    read_text,
    render_comparisons,
    render_contention,
    render_machine,
    render_markdown,
    render_memory,
    render_table,
    render_targets,
    render_tracing_cost,
    to_json,
    wrap,
    write_text,
)
from ._runner import (
    DEFAULT_IMPLS,
    IMPL_KEYS,
    LOOPS,
    MIN_CPU_SHARE,
    WORKLOADS,
    Plan,
    log,
    loop_unavailable,
    measure,
)

__all__ = ["main"]

#: (messages, requests, rounds, memory capacity, sustained publishes, traced envelopes)
FULL = (50_000, 20_000, 5, 100_000, 300_000, 20_000)
QUICK = (5_000, 2_000, 3, 20_000, 60_000, 5_000)


def _csv(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(item.strip() for item in text.split(",") if item.strip())
        unknown = [item for item in items if item not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}; got {text!r}"
            )
        return items

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m asyncbus bench",
        description=(
            "asyncbus side by side with raw anyio streams, asyncio.Queue, a plain call loop, "
            "FastStream and bubus; alternating runs, medians, ratios to the raw stream."
        ),
        epilog=(
            "The brokers end to end, on local servers (see --help there): "
            "'python -m asyncbus bench brokers' (Redis Streams and NATS JetStream vs "
            "hand-written clients and FastStream), 'python -m asyncbus bench postgres' "
            "(PostgreSQL vs hand-written asyncpg) and 'python -m asyncbus bench rabbit' "
            "(RabbitMQ vs hand-written aio-pika). CPU-bound stages, thread and process "
            "offload, on this interpreter and a free-threaded one: 'python -m asyncbus "
            "bench cpu'."
        ),
    )
    parser.add_argument("--quick", action="store_true", help="small counts, 3 rounds (< 1 min)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--markdown",
        metavar="PATH",
        help="write the results into the generated block of this markdown file",
    )
    parser.add_argument(
        "--loops",
        type=_csv(LOOPS),
        default=("asyncio", "uvloop"),
        help="event loops, comma-separated (asyncio, uvloop, trio); default asyncio,uvloop",
    )
    parser.add_argument(
        "--workloads",
        type=_csv([w.key for w in WORKLOADS]),
        default=tuple(w.key for w in WORKLOADS),
        help="workload numbers, e.g. 1,5",
    )
    parser.add_argument(
        "--impls",
        type=_csv(IMPL_KEYS),
        default=DEFAULT_IMPLS,
        help=(
            f"implementations ({', '.join(IMPL_KEYS)}); default all but the traced ones"
            " (otel: instrumented with the API alone, otel-unsampled: the SDK sampling nothing,"
            " otel-sdk: the SDK recording every span); ratios need raw, the tracing cost"
            " asyncbus"
        ),
    )
    parser.add_argument("--rounds", type=int, help="alternating rounds (at least 3)")
    parser.add_argument("--messages", type=int, help="messages per run (peers get fewer)")
    parser.add_argument("--requests", type=int, help="requests per run of workload 5")
    parser.add_argument(
        "--reruns",
        type=int,
        default=2,
        help="run a CPU-starved run again up to this often (default 2; 0: never)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    parser.add_argument(
        "--check",
        action="store_true",
        help="also judge the maintainers' performance targets; exit 1 when one fails",
    )
    return parser


def _command(argv: Sequence[str]) -> str:
    script = sys.argv[0] if sys.argv else ""
    if script.endswith("__main__.py") or not script:
        head = "python -m asyncbus bench"
    else:
        head = f"python {os.path.relpath(script)}"
    return " ".join([head, *map(shlex.quote, argv)])


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark suite; return the process exit code.

    1 when a run of asyncbus itself failed (an error in its rows, or its memory
    measurement), or with ``--check`` when a performance target failed; else 0.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    options = _parser().parse_args(arguments)
    messages, requests, rounds, capacity, sustained, traced = QUICK if options.quick else FULL
    plan = Plan(
        messages=options.messages or messages,
        requests=options.requests or requests,
        rounds=max(3, options.rounds or rounds),
        impls=options.impls,
        reruns=max(0, options.reruns),
    )
    command = _command(arguments)
    info = machine()
    target_loop = (
        "uvloop"
        if "uvloop" in options.loops and not loop_unavailable("uvloop")
        else (options.loops[0])
    )
    started = time.perf_counter()
    log(f"asyncbus benchmark: {command}")

    memory: MemoryReport | None = None
    memory_error = "--no-memory" if options.no_memory else ""
    if not options.no_memory:
        log(f"  memory on {target_loop} (fresh interpreter)")
        try:
            memory = measure_memory(target_loop, capacity, sustained, traced)
        except Exception as error:
            memory_error = f"{type(error).__name__}: {error}"

    measurements: list[Measurement] = []
    for workload in WORKLOADS:
        if workload.key not in options.workloads:
            continue
        for loop in options.loops:
            measurements += measure(workload, loop, plan, log)

    targets = check_targets(measurements, memory, target_loop) if options.check else []
    elapsed = time.perf_counter() - started
    heading = wrap(
        f"asyncbus benchmark: {plan.messages:,} messages per run ({plan.requests:,} for"
        f" request/reply; the slow peers get fewer, see n), {plan.rounds} alternating rounds,"
        f" medians; x raw = median of per-round ratios to the raw anyio stream shaped like"
        f" the workload"
    )
    body = "\n\n".join(
        [
            render_machine(info),
            heading,
            render_table(measurements) + "\n\n" + render_contention(measurements, MIN_CPU_SHARE),
            render_comparisons(measurements, target_loop),
            *filter(None, [render_tracing_cost(measurements)]),
            render_memory(memory, memory_error),
            *([render_targets(targets, target_loop)] if options.check else []),
            f"total time {elapsed:.0f} s",
        ]
    )
    print_out(body)
    if options.json:
        document = to_json(
            info=info,
            command=command,
            plan={
                "messages": plan.messages,
                "requests": plan.requests,
                "rounds": plan.rounds,
                "loops": list(options.loops),
                "quick": options.quick,
            },
            measurements=measurements,
            memory=memory,
            targets=targets,
            target_loop=target_loop,
        )
        write_text(options.json, json.dumps(_finite(document), indent=2, allow_nan=False) + "\n")
    if options.markdown:
        write_text(
            options.markdown,
            render_markdown(
                read_text(options.markdown), command=command, body=body, targets=targets
            ),
        )
    status = 0
    broken = [m for m in measurements if m.impl.key == "asyncbus" and m.status == "error"]
    for m in broken:
        log(f"asyncbus failed on workload {m.workload.key} ({m.loop}): {m.reason}")
        status = 1
    if memory is None and not options.no_memory:
        log(f"asyncbus failed its memory measurement: {memory_error}")
        status = 1
    failed = [target for target in targets if target.passed is False]
    if failed:
        log(f"{len(failed)} target(s) failed: {', '.join(t.name for t in failed)}")
        status = 1
    return status
