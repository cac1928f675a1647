"""Profile asyncbus on one workload with py-spy and list the hot spots in asyncbus code.

    pip install -e '.[bench]'    # py-spy comes with the bench extra
    python benchmarks/profile_hotspots.py [--workload 1] [--loop uvloop] [--messages 200000]

py-spy samples the benchmark process (only asyncbus runs, no baselines) without
stopping it (``--nonblocking``: stopping it at each sample biases the profile
towards system calls, and the event loop's ``select`` then seems to take 80 %).
This script folds the samples four ways, each as a percentage of all samples:

* self: the function itself was on top of the stack;
* attributed: the deepest asyncbus frame of the sample, so time spent in anyio or
  the event loop on behalf of an asyncbus function counts for that function;
* inclusive: the function was anywhere on the stack;
* hot lines: like attributed, but by line.

It also lists the top functions outside asyncbus (anyio, asyncio, uvloop glue).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

_FRAME = re.compile(r"^(?P<function>.+?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _parse(frame: str) -> tuple[str, str, str]:
    found = _FRAME.match(frame.strip())
    if found is None:
        return frame.strip(), "", ""
    return found["function"], found["file"], found["line"] or "?"


def _is_ours(file: str) -> bool:
    ours = "asyncbus/" in file or file.startswith("asyncbus")
    return ours and "benchmarks/" not in file and not file.startswith("suite/")


def _name(function: str, file: str) -> str:
    short = file.split("site-packages/")[-1]
    if "asyncbus/" in short:
        short = "asyncbus/" + short.split("asyncbus/")[-1]
    return f"{short}:{function}"


def fold(lines: list[str]) -> tuple[int, dict[str, collections.Counter[str]]]:
    """Total samples and the self / attributed / inclusive / foreign counters."""
    counters: dict[str, collections.Counter[str]] = {
        key: collections.Counter()
        for key in ("self", "attributed", "inclusive", "lines", "foreign")
    }
    total = 0
    for line in lines:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_parse(frame) for frame in stack.split(";")]
        ours = [(function, file) for function, file, _ in frames if _is_ours(file)]
        seen = set()
        for function, file in ours:
            name = _name(function, file)
            if name not in seen:
                counters["inclusive"][name] += count
                seen.add(name)
        leaf_function, leaf_file, _ = frames[-1]
        if _is_ours(leaf_file):
            counters["self"][_name(leaf_function, leaf_file)] += count
        else:
            counters["foreign"][_name(leaf_function, leaf_file)] += count
        if ours:
            counters["attributed"][_name(*ours[-1])] += count
            function, file, line = next(f for f in reversed(frames) if _is_ours(f[1]))
            counters["lines"][f"{_name(function, file)}:{line}"] += count
        else:
            counters["attributed"]["(outside asyncbus: event loop, task switching)"] += count
    return total, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="1")
    parser.add_argument(
        "--loop",
        choices=("asyncio", "uvloop", "trio"),
        default="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
    )
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--rate", type=int, default=1000, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--raw", metavar="PATH", help="fold an existing py-spy raw file instead")
    options = parser.parse_args(argv)
    if options.raw:
        path = options.raw
    else:
        spy = shutil.which("py-spy")
        if spy is None:
            print("py-spy is not installed: pip install py-spy", file=sys.stderr)
            return 2
        path = os.path.join(tempfile.mkdtemp(), "profile.txt")
        run = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run.py")
        command = [
            spy, "record", "--nonblocking", "--rate", str(options.rate),
            "--format", "raw", "--output", path,
            "--", sys.executable, run, "--workloads", options.workload, "--impls", "asyncbus",
            "--loops", options.loop, "--messages", str(options.messages), "--rounds", "3",
            "--no-memory",
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    with open(path, encoding="utf-8") as file:
        total, counters = fold(file.readlines())
    if not total:
        print("no samples", file=sys.stderr)
        return 1
    where = options.raw or f"workload {options.workload} on {options.loop}"
    print(f"{total} samples, {where}")
    titles = {
        "attributed": "attributed to the deepest asyncbus frame (incl. anyio/loop calls it made)",
        "self": "self time in asyncbus code",
        "inclusive": "inclusive (on the stack)",
        "lines": "hot lines (deepest asyncbus frame, by line)",
        "foreign": "self time outside asyncbus",
    }
    for key, title in titles.items():
        print(f"\n{title}:")
        for name, count in counters[key].most_common(options.top):
            print(f"  {100 * count / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
