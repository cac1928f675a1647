"""The command line's tests drive subprocesses: one event loop is enough (asyncio)."""

from __future__ import annotations

import sys
from pathlib import Path

# ``_command`` (the harness) is imported by name, as the helpers beside the top conftest.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)
