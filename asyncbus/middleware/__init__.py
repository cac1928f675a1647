"""The built-in middleware, one per module, each an ordinary :data:`Middleware`.

Default order around every handler (first listed outermost)::

    dead_letter ▸ routing_slip ▸ expire ▸ retry ▸ timeout ▸ bus middleware ▸
    subscription middleware ▸ handler (offloaded to the worker pool when sync)

A built-in listed in ``Bus(middleware=...)`` or ``subscribe(middleware=...)``
replaces the default of its kind, at the place it is listed.
"""

from __future__ import annotations

from .._types import middleware as middleware
from .dead_letter import dead_letter as dead_letter
from .deduplicate import deduplicate as deduplicate
from .expire import expire as expire
from .retry import Retry as Retry
from .routing_slip import routing_slip as routing_slip
from .timeout import HandlerTimeout as HandlerTimeout
from .timeout import timeout as timeout

__all__ = [
    "HandlerTimeout",
    "Retry",
    "dead_letter",
    "deduplicate",
    "expire",
    "middleware",
    "routing_slip",
    "timeout",
]
