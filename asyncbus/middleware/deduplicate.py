"""Deduplication: effectively-once handling on top of at-least-once delivery.

Without a ``store`` and on a bus in memory, each stage remembers the ids it handled
(this process's handlings, which is all there is), and an id being handled is taken
first: a copy that reaches another consumer meanwhile waits for that handling, then is
skipped (it succeeded) or runs (it failed), never beside it. Over a broker the default store
is the broker's (a :class:`~asyncbus.transports.DedupStoreProvider`), shared by every process of the
group: an envelope is claimed before it is handled, so a redelivery to another
process after a crash is skipped once the first handling succeeded, and handled
once the crashed owner's claim (its lease, extended while it worked) has expired.
A transport without such a store (RabbitMQ) keeps the in-memory behaviour.
"""

from __future__ import annotations

import logging
import secrets
from collections import OrderedDict
from typing import Any

import anyio

from .._checks import check_count, check_seconds
from .._dedup import Claim as Claim
from .._dedup import DedupStore as DedupStore
from .._dedup import MemoryDedupStore as MemoryDedupStore
from .._envelope import HEADER_REPLAYED, Envelope
from .._exceptions import ConfigurationError
from .._handling import Handling, current_handling
from .._types import Handler, Middleware
from .._verdicts import Skip, Verdict
from ._builtin import mark_builtin

__all__ = ["Claim", "DedupStore", "MemoryDedupStore", "deduplicate"]

logger = logging.getLogger("asyncbus.middleware.deduplicate")

#: A duplicate is acked unhandled, and not forwarded along its slip again.
_SKIP = Skip()
#: Longest pause between two looks at a key another owner is handling.
_BUSY_POLL = 1.0
#: Seconds marking or releasing a key may take after the handler ended.
_MARK_TIMEOUT = 5.0


def deduplicate(
    *,
    window: float = 300.0,
    maxlen: int = 100_000,
    store: DedupStore | None = None,
    lease: float = 30.0,
) -> Middleware:
    """Ack without handling an envelope whose id this stage handled within ``window`` s.

    Only successful handling is remembered, so retries go through; replays (header
    ``asyncbus-replayed``) always go through. A copy that arrives while its id is being
    handled waits for that handling's outcome. A skipped duplicate is not forwarded
    along its routing slip again.

    :param window: seconds a handled id is remembered.
    :param maxlen: ids each stage remembers at most in memory (oldest forgotten first).
    :param store: where handled ids are kept (:class:`DedupStore`). By default: the
        broker's store when the bus runs over a broker that has one (shared by every
        process), else this stage's memory.
    :param lease: seconds a claim lasts unless extended; it is extended every
        ``lease / 3`` while the handler runs, so only a dead process's claim expires
        (and its work is then done by whoever gets the redelivery). With a store.
    :raises ConfigurationError: for a window or lease that is not a finite number > 0,
        a maxlen that is not an int >= 1, or a store that is not a :class:`DedupStore`.
    """
    window = check_seconds(window, "deduplicate: window")
    lease = check_seconds(lease, "deduplicate: lease")
    check_count(maxlen, "deduplicate: maxlen", 1)
    if store is not None and not isinstance(store, DedupStore):
        raise ConfigurationError(f"deduplicate: store {store!r} is not a DedupStore")

    def wrap(call_next: Handler) -> Handler:
        seen: OrderedDict[str, float] = OrderedDict()
        # The store of this chain, found at its first envelope (the bus is known then).
        chosen: list[DedupStore | None] = [store] if store is not None else []

        # Ids being handled now, each with the event its handling sets when it ends: a
        # copy that arrives meanwhile waits for that outcome instead of running beside it.
        handling_now: dict[str, anyio.Event] = {}

        async def in_memory(envelope: Envelope) -> Any:
            key = envelope.id
            replayed = HEADER_REPLAYED in envelope.headers  # a replay always runs
            while not replayed and (running := handling_now.get(key)) is not None:
                await running.wait()  # done: skipped below; failed: this one runs
            now = anyio.current_time()  # the loop's clock: a test's MockClock drives it
            horizon = now - window
            while seen:
                oldest = next(iter(seen))
                if seen[oldest] > horizon:
                    break
                del seen[oldest]
            if key in seen and not replayed:
                return _SKIP
            ended: anyio.Event | None = None
            if key not in handling_now:  # (a replay beside a running copy claims nothing)
                ended = handling_now[key] = anyio.Event()
            try:
                result = await call_next(envelope)
                if not isinstance(result, Verdict):
                    seen[key] = now
                    seen.move_to_end(key)
                    if len(seen) > maxlen:
                        seen.popitem(last=False)
            finally:
                if ended is not None:
                    del handling_now[key]
                    ended.set()
            return result

        async def handle(envelope: Envelope) -> Any:
            handling = current_handling()
            if not chosen:
                chosen.append(handling.host.dedup_store(window) if handling is not None else None)
            found = chosen[0]
            if found is None:
                return await in_memory(envelope)
            return await _claimed(found, envelope, handling, call_next, window, lease)

        return handle

    return mark_builtin(wrap, "deduplicate")


async def _claimed(
    store: DedupStore,
    envelope: Envelope,
    handling: Handling | None,
    call_next: Handler,
    window: float,
    lease: float,
) -> Any:
    """Handle ``envelope`` under a claim in ``store`` (see the module docstring)."""
    key = f"{handling.stage.name if handling is not None else ''}/{envelope.id}"
    owner = secrets.token_hex(8)
    if HEADER_REPLAYED not in envelope.headers:  # a replay always runs
        pause = min(lease / 8, _BUSY_POLL)
        while (state := await store.claim(key, owner, lease)) is Claim.BUSY:
            # Being handled elsewhere right now: wait for its outcome (done: skip it;
            # failed or its owner died: the claim comes free and this one runs).
            await anyio.sleep(pause)
            pause = min(pause * 2, _BUSY_POLL)
        if state is Claim.DONE:
            return _SKIP
    holding = anyio.Event()
    if handling is not None:
        handling.host.start_soon(_keep_claim, store, key, owner, lease, holding)
    succeeded = False
    try:
        result = await call_next(envelope)
        succeeded = not isinstance(result, Verdict)
    finally:
        holding.set()
        # Shielded: a cancelled handling still gives its claim back (bounded).
        with anyio.CancelScope(shield=True), anyio.move_on_after(_MARK_TIMEOUT):
            try:
                if succeeded:
                    await store.done(key, owner, window)
                else:
                    await store.release(key, owner)
            except Exception as error:  # the claim expires after its lease anyway
                logger.warning("deduplicate: could not settle the claim of %s: %s", key, error)
    return result


async def _keep_claim(
    store: DedupStore, key: str, owner: str, lease: float, holding: anyio.Event
) -> None:
    """Extend the claim every ``lease / 3`` until the handling ends (``holding`` set)."""
    while True:
        with anyio.move_on_after(lease / 3):
            await holding.wait()
            return
        try:
            if not await store.extend(key, owner, lease):
                logger.warning("deduplicate: the claim of %s expired while handling it", key)
                return
        except Exception as error:  # try again next time: the lease has some left
            logger.warning("deduplicate: could not extend the claim of %s: %s", key, error)
