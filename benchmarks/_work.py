"""The reference CPU-bound work of ``cpu_stages.py``.

It lives in its own module, not in the script, so that a worker process started by
``offload="process"`` can import it by name: the child receives the parent's
``sys.path`` (which holds this directory when the script runs), unpickles
``_work.crunch`` and imports this module, without re-running any benchmark.

The work is plain Python arithmetic on small numbers: on a GIL build the whole loop
holds the GIL (a fair test of what threads can do), and on a free-threaded build two
threads running it share nothing. Measured on a free-threaded 3.13 here (two threads
against the same two calls in a row, no bus, a quiet machine where two processes ran
1.97x): a ``hashlib.sha256`` loop over 32-byte digests ran 0.8-1.5x (OpenSSL 3.0's own
locks), an LCG with large constants 0.9-1.3x (3.13 does not make the constants of a
module loaded from a .pyc immortal, so each use updates a reference count both
threads share), the same LCG on numbers made by each call 1.3-1.5x (multi-digit
ints), and this loop 1.8-2.05x.
"""

from __future__ import annotations

__all__ = ["ROUNDS", "crunch", "nothing"]

#: Steps per envelope in the reference workload (about 13 ms on CPython 3.11 here).
ROUNDS = 150_000


def crunch(job: tuple[bytes, int]) -> str:
    """Step a small linear congruential generator ``rounds`` times from ``seed``."""
    seed, rounds = job
    bits = 16
    mask = (1 << bits) - 1  # made here, not a constant: see the module's docstring
    state = int.from_bytes(seed, "big") & mask
    for step in range(rounds):
        state = (state * 75 + 74 + step) & mask
    return f"{state:04x}"


def nothing(value: object) -> None:
    """The handler that measures the bus's own cost per envelope: it does no work."""
