"""The two clocks the bus reads, and why each.

* **The event loop's clock** (``anyio.current_time()``: ``loop.time()`` on asyncio,
  the run's clock on trio) measures every duration the process decides on by itself:
  retry delays, handler and publish timeouts, ``drain``/``aclose`` deadlines, the
  dead-letter TTL and the ``deduplicate`` window. It is the one clock a test injects:
  trio's ``MockClock`` (``anyio_backend = ("trio", {"clock": MockClock(autojump_threshold=0)})``)
  drives all of them without a real sleep.
* **The wall clock** (``time.time()``, epoch seconds) stamps what other processes read:
  ``Envelope.timestamp`` (and so ``ttl`` expiry, judged against the envelope's own
  timestamp wherever it is handled), ``DeadLetter.dead_at`` and envelope ids.

Latency statistics use ``time.perf_counter``: they measure what really happened,
they decide nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from ._runtime import current_backend

__all__ = ["Clock", "loop_clock"]

#: A clock: seconds as a float, only differences meaningful.
Clock = Callable[[], float]


def loop_clock() -> Clock:
    """The running event loop's clock as a plain function, callable from anywhere.

    Unlike ``anyio.current_time`` it keeps working after the loop stopped (a closed
    bus still expires its dead letters), and from other threads.
    """
    if current_backend() == "trio":
        import trio

        return trio.lowlevel.current_clock().current_time
    import asyncio

    return asyncio.get_running_loop().time
