"""The reference CPU-bound work of ``cpu_stages.py``.

It lives in its own module, not in the script, so that a worker process started by
``offload="process"`` can import it by name: the child receives the parent's
``sys.path`` (which holds this directory when the script runs), unpickles
``_work.chained_sha256`` and imports this module, without re-running any benchmark.
"""

from __future__ import annotations

import hashlib

__all__ = ["ROUNDS", "chained_sha256", "nothing"]

#: sha256 rounds per envelope in the reference workload.
ROUNDS = 40_000


def chained_sha256(job: tuple[bytes, int]) -> str:
    """Hash ``seed`` ``rounds`` times, each round hashing the previous digest.

    The input stays 32 bytes, below the size at which hashlib releases the GIL, so
    on a GIL build the whole loop holds it: a fair test of what threads can do.
    """
    seed, rounds = job
    digest = seed
    for _ in range(rounds):
        digest = hashlib.sha256(digest).digest()
    return digest.hex()


def nothing(value: object) -> None:
    """The handler that measures the bus's own cost per envelope: it does no work."""
