"""RabbitMQ end to end: asyncbus over RabbitTransport vs a hand-written aio-pika loop.

Same as ``python -m asyncbus bench rabbit``; the benchmark lives in ``suite/_rabbit.py``.
"""

from __future__ import annotations

import sys

from suite._rabbit import main

if __name__ == "__main__":
    sys.exit(main())
