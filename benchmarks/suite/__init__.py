"""The benchmark suite behind ``benchmarks/run.py`` and ``python -m asyncbus bench``.

Every workload runs against its baselines in the same process, in alternating
rounds, on asyncio and uvloop: a raw anyio memory object stream shaped like the
workload, ``asyncio.Queue``, a plain synchronous call loop (the floor), and the peers
FastStream and bubus (``pip install -e '.[bench]'``, imported lazily). Then the
ratios to the peers and memory; with ``--check``, the maintainers' performance
targets, each PASS or FAIL.
"""

from __future__ import annotations

from ._cli import main as main

__all__ = ["main"]
