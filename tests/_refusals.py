"""A transport's ``subscribe`` that refuses some patterns for good, as a broker's limit would."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import anyio.lowlevel

from asyncbus import ConfigurationError
from asyncbus.transports import Delivery

Subscribe = Callable[..., AbstractAsyncContextManager[AsyncIterator[Delivery]]]


def refusing(subscribe: Subscribe, prefix: str = "refused") -> Subscribe:
    """``subscribe``, except that a pattern beginning with ``prefix`` fails on entering
    with a ``ConfigurationError`` (after a checkpoint, as a broker's answer would)."""

    def picky(
        pattern: str, *, group: str, prefetch: int
    ) -> AbstractAsyncContextManager[AsyncIterator[Delivery]]:
        if not pattern.startswith(prefix):
            return subscribe(pattern, group=group, prefetch=prefetch)

        @asynccontextmanager
        async def refuse() -> AsyncIterator[AsyncIterator[Delivery]]:
            await anyio.lowlevel.checkpoint()
            raise ConfigurationError(f"this broker cannot take the pattern {pattern!r}")
            yield  # pragma: no cover

        return refuse()

    return picky
