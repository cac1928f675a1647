"""The benchmark suite behind ``python -m asyncbus bench`` and ``benchmarks/run.py``.

Every workload of issue 5 runs against its baselines in the same process, in
alternating rounds, on asyncio and uvloop: a raw anyio memory object stream shaped
like the workload, ``asyncio.Queue``, a plain synchronous call loop (the floor),
and the peers FastStream and bubus (``pip install 'asyncbus[bench]'``, imported
lazily). Then memory, then the targets, each PASS or FAIL.
"""

from __future__ import annotations

from ._cli import main as main

__all__ = ["main"]
