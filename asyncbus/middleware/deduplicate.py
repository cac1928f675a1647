"""Deduplication: effectively-once handling on top of at-least-once delivery."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import anyio

from .._checks import check_count, check_seconds
from .._dispatch import current_dispatch
from .._envelope import HEADER_REPLAYED, Envelope
from .._types import Handler, Middleware
from ._builtin import mark_builtin

__all__ = ["deduplicate"]


def deduplicate(*, window: float = 300.0, maxlen: int = 100_000) -> Middleware:
    """Ack without handling an envelope whose id this stage handled within ``window`` s.

    Each stage keeps its own memory of at most ``maxlen`` ids (oldest forgotten
    first). Only successful handling is remembered, so retries go through; replays
    (header ``asyncbus-replayed``) always go through. A skipped duplicate is not
    forwarded along its routing slip again.

    :raises ConfigurationError: for a window that is not a finite number > 0, or a
        maxlen that is not an int >= 1.
    """
    window = check_seconds(window, "deduplicate: window")
    check_count(maxlen, "deduplicate: maxlen", 1)

    def wrap(call_next: Handler) -> Handler:
        seen: OrderedDict[str, float] = OrderedDict()

        async def handle(envelope: Envelope) -> Any:
            now = anyio.current_time()  # the loop's clock: a test's MockClock drives it
            horizon = now - window
            while seen:
                oldest = next(iter(seen))
                if seen[oldest] > horizon:
                    break
                del seen[oldest]
            if envelope.id in seen and HEADER_REPLAYED not in envelope.headers:
                dispatch = current_dispatch()
                if dispatch is not None:
                    dispatch.skip()
                return None
            result = await call_next(envelope)
            dispatch = current_dispatch()
            if dispatch is None or dispatch.outcome is None:
                seen[envelope.id] = now
                seen.move_to_end(envelope.id)
                if len(seen) > maxlen:
                    seen.popitem(last=False)
            return result

        return handle

    return mark_builtin(wrap, "deduplicate")
