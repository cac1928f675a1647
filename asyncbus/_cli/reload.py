"""``--reload``: the Python files that changed, from watchfiles (the ``reload`` extra)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence

import anyio

from . import CommandError

__all__ = ["changes", "check_available"]

#: Milliseconds of quiet before a burst of changes (an editor's save, a git checkout)
#: counts as one.
_DEBOUNCE_MS = 300


def check_available() -> None:
    """:raises CommandError: without watchfiles."""
    try:
        import watchfiles  # noqa: F401
    except ImportError:
        raise CommandError("--reload needs watchfiles: pip install 'asyncbus[reload]'") from None


async def changes(paths: Sequence[str], stop: anyio.Event) -> AsyncIterator[str]:
    """Yield, for each burst of changes to Python files under ``paths``, one path (the
    first that changed, relative to the current directory) until ``stop`` is set."""
    from watchfiles import PythonFilter, awatch

    async for burst in awatch(
        *paths, watch_filter=PythonFilter(), debounce=_DEBOUNCE_MS, stop_event=stop
    ):
        changed = sorted(path for _, path in burst)
        if changed:
            yield os.path.relpath(changed[0])
