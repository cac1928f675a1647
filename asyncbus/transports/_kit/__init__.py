"""The broker kit: the plumbing every broker transport shares, written once.

* :class:`~asyncbus.transports.base.BaseDelivery` (in :mod:`.delivery`): the
  settle-once delivery every transport hands out;
* :class:`AckWriter`: acks queued by ``ack_nowait`` and written behind, in batches;
* :class:`Backoff`: the pause between two attempts of anything retried;
* :func:`redact`: a broker URL fit for logs and errors (no credentials);
* :class:`TaskOwner`: the one task group a transport owns from connect to close;
* :func:`require_asyncio`: the one check (and error) of an asyncio-only client;
* :func:`require_extra`, :func:`check_url`, :func:`split_urls`: what a transport checks
  as it is created (its client library, :class:`MissingExtra` when absent; its URLs);
* :class:`TopicMatches`: which recorded groups a topic reaches, cached per topic;
* :mod:`.options`: a transport's options checked (timeouts, ``prefetch``, the message
  size limit) and envelopes over that limit refused;
* :mod:`.redeliveries`: ``max_deliveries``, counted the same way by every broker
  (hand-backs carry the count in ``asyncbus-deliveries``);
* :mod:`.routes`: the bus's request-inbox groups (which groups are inboxes, how long a
  dead process's inbox stays) and the ``no_subscribers`` dead letter;
* :class:`~.verbatim.Verbatim`: the codec that keeps an undecodable body as it came;
* :mod:`.plain`: the envelope of a plain message, one another client wrote without the
  bus's meta (its body the payload, the rest from the broker's own fields).
"""

from __future__ import annotations

from .acks import AckWriter as AckWriter
from .backoff import Backoff as Backoff
from .matches import TopicMatches as TopicMatches
from .redact import redact as redact
from .runtime import MissingExtra as MissingExtra
from .runtime import check_url as check_url
from .runtime import require_asyncio as require_asyncio
from .runtime import require_extra as require_extra
from .runtime import split_urls as split_urls
from .tasks import TaskOwner as TaskOwner

__all__ = [
    "AckWriter",
    "Backoff",
    "MissingExtra",
    "TaskOwner",
    "TopicMatches",
    "check_url",
    "redact",
    "require_asyncio",
    "require_extra",
    "split_urls",
]
