"""Brokers end to end: asyncbus over Redis Streams and NATS JetStream vs hand-written clients.

Same as ``python -m asyncbus bench brokers``; the benchmark lives in ``suite/_brokers.py``.
"""

from __future__ import annotations

import sys

from suite._brokers import main

if __name__ == "__main__":
    sys.exit(main())
