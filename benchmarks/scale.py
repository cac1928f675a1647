"""Scale-out over a broker: one group's work shared by 1, 2 and 4 consumer processes.

``python benchmarks/scale.py [--brokers redis,nats,rabbit] [--messages 20000]
[--processes 1,2,4] [--concurrency 32] [--work 0] [--redis URL] [--nats URL]
[--rabbit URL] [--redis-cluster URLS] [--nats-cluster URLS] [--rabbit-cluster URLS]
[--json PATH] [--check]``
(also ``python -m asyncbus bench scale ...``)

For each broker (and each cluster given: ``--redis-cluster`` with ``cluster=True``,
``--nats-cluster`` and ``--rabbit-cluster`` with ``replicas=3``), a backlog of
``messages`` envelopes is stored in one group first; then ``N`` worker processes, each a
:class:`~asyncbus.Bus` with one subscription to that group (``concurrency`` handlers,
each spinning ``--work`` seconds of CPU, or only yielding), are started, and once every
one is subscribed (each holding its prefetch) told to go together; they are timed from
the first envelope handled to the last (their wall clocks: one machine). It prints, per
broker and ``N``, envelopes per second, the ratio to one process, and the CPU the
workers spent per envelope (user plus system time of every worker, in microseconds): the
bus side's cost, which is what more machines divide.

The ratio is bounded by the machine: with two cores, two processes can at best double
the rate of one only when one process does not already use both cores (the broker
server runs on the same cores). ``--check`` exits 1 when an envelope was lost or
handled twice; there is no throughput target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from asyncbus import Bus, Envelope
from suite._brokers import nats_delete_streams, redis_delete_prefix

TOPIC = "scale.jobs"
GROUP = "workers"
#: Envelopes per publish call while the backlog is stored.
BATCH = 500
DEFAULTS = {
    "redis": "redis://127.0.0.1:6379/0",
    "nats": "nats://127.0.0.1:4222",
    "rabbit": "amqp://guest:guest@127.0.0.1:5672/",
}


def make_transport(kind: str, url: str, prefix: str, cluster: bool) -> Any:
    """The transport of ``kind`` at ``url`` (several nodes with ``cluster``)."""
    urls = url.split(",")
    if kind == "redis":
        from asyncbus.transports.redis import RedisTransport

        return RedisTransport(urls if cluster else url, prefix=prefix, cluster=cluster)
    if kind == "nats":
        from asyncbus.transports.nats import NatsTransport

        return NatsTransport(urls, prefix=prefix, replicas=3 if cluster else 1)
    from asyncbus.transports.rabbit import RabbitTransport

    return RabbitTransport(urls, prefix=prefix, replicas=3 if cluster else None)


# -- a worker process -------------------------------------------------------------


async def work_until_told(spec: dict[str, Any]) -> None:
    """One worker: handle the group's envelopes until stdin closes, then report."""
    bus = Bus(transport=make_transport(spec["kind"], spec["url"], spec["prefix"], spec["cluster"]))
    handled: list[int] = []
    #: When the first and the last envelope were handled (wall clock: one machine).
    stamps: list[float] = []
    spin = float(spec["work"])
    go = anyio.Event()

    @bus.subscribe(TOPIC, group=GROUP, concurrency=int(spec["concurrency"]))
    async def handle(n: int) -> None:
        await go.wait()
        if spin:
            until = time.perf_counter() + spin
            while time.perf_counter() < until:
                pass
        else:
            await anyio.lowlevel.checkpoint()
        handled.append(n)
        now = time.time()
        if stamps:
            stamps[1] = now
        else:
            stamps.extend((now, now))

    async with bus:
        cpu = time.process_time()
        print(json.dumps({"ready": True}), flush=True)

        async def tell_progress() -> None:
            while True:
                await anyio.sleep(0.05)
                print(json.dumps({"handled": len(handled)}), flush=True)

        async with anyio.create_task_group() as progress:
            progress.start_soon(tell_progress)
            await anyio.to_thread.run_sync(sys.stdin.readline)  # "go": every worker is up
            go.set()
            await anyio.to_thread.run_sync(sys.stdin.read)  # until the parent closes it
            progress.cancel_scope.cancel()
        cpu = time.process_time() - cpu
    first, last = stamps or (0.0, 0.0)
    Path(spec["out"]).write_text(
        json.dumps({"handled": handled, "first": first, "last": last, "cpu": cpu})
    )


# -- the parent ----------------------------------------------------------------------


@dataclass
class Outcome:
    """One run: a broker, a deployment, ``processes`` workers."""

    broker: str
    deployment: str
    processes: int
    per_second: float
    cpu_us_per_envelope: float
    lost: int
    twice: int
    per_process: list[int] = field(default_factory=list)


async def store_backlog(kind: str, url: str, prefix: str, cluster: bool, messages: int) -> None:
    """Make the group, then publish ``messages`` envelopes (payloads 0..messages-1)."""
    transport = make_transport(kind, url, prefix, cluster)
    async with transport:
        async with transport.subscribe(TOPIC, group=GROUP, prefetch=1):
            pass  # the group exists from here on: what is published next is its
        for start in range(0, messages, BATCH):
            batch = [
                Envelope(topic=TOPIC, payload=n) for n in range(start, min(messages, start + BATCH))
            ]
            await transport.publish(TOPIC, batch)


async def forget(kind: str, url: str, prefix: str, cluster: bool) -> None:
    """Delete the run's group; on NATS its streams, on one Redis server every key of its
    prefix too."""
    transport = make_transport(kind, url, prefix, cluster)
    with contextlib.suppress(Exception):
        async with transport:
            await transport.delete_group(TOPIC, GROUP)
    if kind == "nats":
        with contextlib.suppress(Exception):  # (any node of a cluster will do)
            first = url.split(",")[0]
            await nats_delete_streams(first, transport.stream, transport.dead_letter_stream)
    if kind == "redis" and not cluster:
        await redis_delete_prefix(url, prefix)


async def one_run(
    args: argparse.Namespace, kind: str, url: str, cluster: bool, count: int
) -> Outcome:
    """Store the backlog, start ``count`` workers together, time them through it."""
    prefix = f"scale{secrets.token_hex(4)}"
    await store_backlog(kind, url, prefix, cluster, args.messages)
    with tempfile.TemporaryDirectory() as folder:
        outs = [Path(folder) / f"worker-{n}.json" for n in range(count)]
        workers = []
        try:
            for out in outs:
                spec = {
                    "kind": kind,
                    "url": url,
                    "prefix": prefix,
                    "cluster": cluster,
                    "concurrency": args.concurrency,
                    "work": args.work,
                    "out": str(out),
                }
                workers.append(
                    await anyio.open_process(
                        [sys.executable, __file__, "--worker", json.dumps(spec)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=None,
                    )
                )
            handled = [0] * count
            ready = [anyio.Event() for _ in workers]
            done = anyio.Event()

            async def follow(index: int, process: anyio.abc.Process) -> None:
                assert process.stdout is not None
                buffer = b""
                async for chunk in process.stdout:
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        report = json.loads(line)
                        if "ready" in report:
                            ready[index].set()
                        if "handled" in report:
                            handled[index] = report["handled"]
                            if sum(handled) >= args.messages:
                                done.set()

            with anyio.fail_after(args.timeout):
                async with anyio.create_task_group() as following:
                    for index, process in enumerate(workers):
                        following.start_soon(follow, index, process)
                    for event in ready:
                        await event.wait()
                    for process in workers:  # together: each has taken its prefetch
                        assert process.stdin is not None
                        await process.stdin.send(b"go\n")
                    await done.wait()
                    await anyio.sleep(0.3)  # (a copy handled twice would show by now)
                    for process in workers:
                        assert process.stdin is not None
                        await process.stdin.aclose()
                    for process in workers:
                        await process.wait()
        finally:
            for process in workers:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
        reports = [json.loads(out.read_text()) for out in outs]
    await forget(kind, url, prefix, cluster)
    everything = [n for report in reports for n in report["handled"]]
    busy = [report for report in reports if report["handled"]]
    span = max(1e-9, max(r["last"] for r in busy) - min(r["first"] for r in busy))
    return Outcome(
        broker=kind,
        deployment="cluster" if cluster else "one node",
        processes=count,
        per_second=args.messages / span,
        cpu_us_per_envelope=sum(report["cpu"] for report in reports) / args.messages * 1e6,
        lost=args.messages - len(set(everything)),
        twice=len(everything) - len(set(everything)),
        per_process=[len(report["handled"]) for report in reports],
    )


def deployments(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(broker, url, cluster) for every broker and cluster asked for."""
    chosen = []
    for kind in args.brokers.split(","):
        chosen.append((kind, getattr(args, kind) or DEFAULTS[kind], False))
    if args.redis_cluster:
        chosen.append(("redis", args.redis_cluster, True))
    if args.nats_cluster:
        chosen.append(("nats", args.nats_cluster, True))
    if args.rabbit_cluster:
        chosen.append(("rabbit", args.rabbit_cluster, True))
    return chosen


async def measure(args: argparse.Namespace) -> list[Outcome]:
    outcomes = []
    counts = [int(n) for n in args.processes.split(",")]
    for kind, url, cluster in deployments(args):
        for count in counts:
            runs = [await one_run(args, kind, url, cluster, count) for _ in range(args.rounds)]
            best = sorted(runs, key=lambda run: run.per_second)[len(runs) // 2]  # the median
            outcomes.append(best)
            print(
                f"{kind:6} {best.deployment:8} {count} process(es): "
                f"{best.per_second:9,.0f} env/s, {best.cpu_us_per_envelope:6.0f} us CPU/env, "
                f"split {best.per_process}, lost {best.lost}, twice {best.twice}",
                flush=True,
            )
    return outcomes


def table(outcomes: list[Outcome]) -> list[str]:
    lines = [
        "| broker | deployment | processes | envelopes/s | ratio to 1 process "
        "| CPU per envelope (us) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for outcome in outcomes:
        one = next(
            o
            for o in outcomes
            if (o.broker, o.deployment, o.processes) == (outcome.broker, outcome.deployment, 1)
        )
        lines.append(
            f"| {outcome.broker} | {outcome.deployment} | {outcome.processes} | "
            f"{outcome.per_second:,.0f} | {outcome.per_second / one.per_second:.2f}x | "
            f"{outcome.cpu_us_per_envelope:.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", default="redis,nats,rabbit")
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--work", type=float, default=0.0, help="CPU seconds per envelope")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0)
    for kind in DEFAULTS:
        parser.add_argument(f"--{kind}", default=None, help=f"default {DEFAULTS[kind]}")
    parser.add_argument("--redis-cluster", default=None, help="node URLs, comma-separated")
    parser.add_argument("--nats-cluster", default=None, help="node URLs, comma-separated")
    parser.add_argument("--rabbit-cluster", default=None, help="node URLs, comma-separated")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        anyio.run(work_until_told, json.loads(args.worker))
        return 0
    print(f"{os.cpu_count()} CPUs; {args.messages} envelopes per run, work {args.work} s each")
    outcomes = anyio.run(measure, args)
    print("\n".join(table(outcomes)))
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    bad = [o for o in outcomes if o.lost or o.twice]
    if bad:
        print(f"MISSED: envelopes lost or handled twice in {len(bad)} run(s)")
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
