"""The built-in middleware, one per module, each an ordinary :data:`Middleware`.

A middleware settles an envelope otherwise than by an ack by *returning* a verdict
(:class:`Skip`, :class:`RetryAfter`, :class:`DeadLetterNow`) instead of a result; the
stage's consumer carries it out. The built-ins use nothing else, so a user's
middleware written against these names can replace any of them.

Default order around every handler (first listed outermost)::

    dead_letter ▸ routing_slip ▸ expire ▸ retry ▸ timeout ▸ bus middleware ▸
    subscription middleware ▸ handler (offloaded to the worker pool when sync)

A built-in listed in ``Bus(middleware=...)`` or ``subscribe(middleware=...)``
replaces the default of its kind, at the place it is listed.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Awaitable, Callable
from typing import Any

from .._envelope import Envelope
from .._types import Handler, Middleware
from .._types import middleware as middleware
from .._verdicts import DeadLetterNow as DeadLetterNow
from .._verdicts import Defer as Defer
from .._verdicts import RetryAfter as RetryAfter
from .._verdicts import Skip as Skip
from .._verdicts import Verdict as Verdict
from .dead_letter import dead_letter as dead_letter
from .deduplicate import Claim as Claim
from .deduplicate import DedupStore as DedupStore
from .deduplicate import MemoryDedupStore as MemoryDedupStore
from .deduplicate import deduplicate as deduplicate
from .expire import expire as expire
from .rate_limit import RateLimit as RateLimit
from .retry import Retry as Retry
from .routing_slip import routing_slip as routing_slip
from .timeout import HandlerTimeout as HandlerTimeout
from .timeout import timeout as timeout

__all__ = [
    "Claim",
    "DeadLetterNow",
    "DedupStore",
    "Defer",
    "HandlerTimeout",
    "MemoryDedupStore",
    "RateLimit",
    "Retry",
    "RetryAfter",
    "Skip",
    "Verdict",
    "dead_letter",
    "deduplicate",
    "expire",
    "middleware",
    "routing_slip",
    "timeout",
]


class _CallablePackage(types.ModuleType):
    """``asyncbus.middleware`` is both this package and the ``@middleware`` sugar.

    ``from asyncbus import middleware`` must decorate, and ``import asyncbus.middleware``
    must give the built-ins; the attribute of ``asyncbus`` can hold only one object, so
    the package itself is callable and decorates like :func:`middleware`.
    """

    def __call__(self, function: Callable[[Envelope, Handler], Awaitable[Any]]) -> Middleware:
        return middleware(function)


sys.modules[__name__].__class__ = _CallablePackage
