"""Deduplication: effectively-once handling on top of at-least-once delivery."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from .._dispatch import current_dispatch
from .._envelope import HEADER_REPLAYED, Envelope
from .._exceptions import ConfigurationError
from .._types import Handler, Middleware
from ._builtin import mark_builtin

__all__ = ["deduplicate"]


def deduplicate(*, window: float = 300.0, maxlen: int = 100_000) -> Middleware:
    """Ack without handling an envelope whose id this stage handled within ``window`` s.

    Each stage keeps its own memory of at most ``maxlen`` ids (oldest forgotten
    first). Only successful handling is remembered, so retries go through; replays
    (header ``asyncbus-replayed``) always go through. A skipped duplicate is not
    forwarded along its routing slip again.

    :raises ConfigurationError: for a window or maxlen that is not positive.
    """
    if window <= 0 or maxlen < 1:
        raise ConfigurationError(
            f"deduplicate: window must be > 0 and maxlen >= 1, got {window!r}, {maxlen!r}"
        )

    def wrap(call_next: Handler) -> Handler:
        seen: OrderedDict[str, float] = OrderedDict()

        async def handle(envelope: Envelope) -> Any:
            now = time.monotonic()
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
