"""What each piece of a publish costs on workload 1, measured by taking it away.

    python benchmarks/hot_path_costs.py [--messages 50000] [--rounds 9] [--loop uvloop]

A sampling profiler misplaces time when every message switches tasks twice (the
samples land on whatever frame resumed last), so this script subtracts instead: it
runs workload 1 (one stage, one async handler, ``await publish`` each, ``drain``)
as it is, then with one piece replaced by a constant (the envelope id, the envelope,
the receipt), alternating the variants round by round in one process, and prints the
median µs per message of each and its difference to the real thing. The fairness
floor (two tasks, one yield each per message, nothing else) runs in the same rounds:
what is left between it and the bus is the bus's own Python work.

The replacements are for measuring only: a constant envelope or receipt is wrong for
any real use, and every run still checks that the handler ran once per message.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from collections.abc import Callable
from time import perf_counter
from typing import Any

import anyio

import asyncbus._publishing as bus_module
from asyncbus import Bus
from asyncbus._envelope import EMPTY_HEADERS, make_envelope, make_receipt
from suite._baselines import fairness_floor_one

_ORIGINAL = {
    name: getattr(bus_module, name) for name in ("new_id", "make_envelope", "make_receipt")
}
_ENVELOPE = make_envelope(
    "constant", "bench.one", {}, EMPTY_HEADERS, 0.0, None, 1, (), "constant", None, None, None
)
_RECEIPT = make_receipt("constant", ("bench.one@bench",))

#: Variant name -> the module globals of asyncbus._publishing it replaces.
VARIANTS: dict[str, dict[str, Callable[..., Any]]] = {
    "as it is": {},
    "id constant": {"new_id": lambda: "constant"},
    "envelope constant": {"make_envelope": lambda *fields: _ENVELOPE},
    "receipt constant": {"make_receipt": lambda *fields: _RECEIPT},
}


async def _workload_one(messages: list[dict[str, int]]) -> float:
    handled = 0

    async def handle(payload: dict[str, int]) -> None:
        nonlocal handled
        handled += 1

    bus = Bus()
    bus.subscribe("bench.one", handle, group="bench")
    async with bus:
        await anyio.sleep(0)
        publish = bus.publish
        started = perf_counter()
        for message in messages:
            await publish("bench.one", message)
        await bus.drain()
        seconds = perf_counter() - started
    if handled != len(messages):
        raise AssertionError(f"handled {handled} of {len(messages)}")
    return seconds / len(messages) * 1e6


async def _floor(messages: list[dict[str, int]]) -> float:
    sample = await fairness_floor_one(messages)
    if sample.handled != len(messages):
        raise AssertionError(f"handled {sample.handled} of {len(messages)}")
    return sample.seconds / len(messages) * 1e6


def _run(loop: str, function: Callable[..., Any], *args: Any) -> float:
    options = {"use_uvloop": True} if loop == "uvloop" else {}
    result: float = anyio.run(function, *args, backend="asyncio", backend_options=options)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        help="event loop (default: uvloop when installed, else asyncio)",
    )
    options = parser.parse_args()
    messages = [{"id": index} for index in range(options.messages)]
    timings: dict[str, list[float]] = {name: [] for name in [*VARIANTS, "fairness floor"]}
    for _ in range(options.rounds):
        for name, replacements in VARIANTS.items():
            for global_name, original in _ORIGINAL.items():
                setattr(bus_module, global_name, replacements.get(global_name, original))
            try:
                timings[name].append(_run(options.loop, _workload_one, messages))
            finally:
                for global_name, original in _ORIGINAL.items():
                    setattr(bus_module, global_name, original)
        timings["fairness floor"].append(_run(options.loop, _floor, messages))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    real = medians["as it is"]
    print(
        f"workload 1 on {options.loop}: {options.messages:,} messages, "
        f"{options.rounds} alternating rounds, medians"
    )
    print(f"  {'variant':<20} {'µs/msg':>8} {'vs as it is':>12}")
    for name, value in medians.items():
        delta = "" if name == "as it is" else f"{value - real:+.2f}"
        print(f"  {name:<20} {value:8.2f} {delta:>12}")
    print(f"  the bus's own work beyond the two yields: {real - medians['fairness floor']:.2f} µs")


if __name__ == "__main__":
    main()
