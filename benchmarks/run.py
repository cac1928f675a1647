"""Run the asyncbus benchmark suite: ``python benchmarks/run.py [--quick] [--json PATH]``.

The suite is the package ``suite`` next to this script (``python -m asyncbus bench``
runs it too, from a checkout); see ``--help`` and docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from suite import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
