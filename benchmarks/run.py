"""Run the asyncbus benchmark suite: ``python benchmarks/run.py [--quick] [--json PATH]``.

The suite lives in ``asyncbus._bench`` (also ``python -m asyncbus bench``); see
``--help`` and docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from asyncbus._bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
