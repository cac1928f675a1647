"""PostgreSQL end to end: asyncbus over PostgresTransport vs a hand-written asyncpg loop.

Same as ``python -m asyncbus bench postgres``; the benchmark lives in ``suite/_postgres.py``.
"""

from __future__ import annotations

import sys

from suite._postgres import main

if __name__ == "__main__":
    sys.exit(main())
