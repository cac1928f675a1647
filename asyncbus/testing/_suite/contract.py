"""The suite's tests of the contract itself: what ``capabilities``, ``bind``, acks
written behind and the dedup store promise."""

from __future__ import annotations

import secrets

import anyio
import pytest

from ..._dedup import Claim, DedupStore
from ..._exceptions import TransportError
from ...transports.base import (
    AcksWrittenBehind,
    BacklogReader,
    DeadLetterStore,
    DedupStoreProvider,
    Transport,
    TransportSettings,
)
from .base import SuiteBase
from .support import QUIET, _check, _envelopes, _next


class ContractTests(SuiteBase):
    """The contract itself: ``capabilities``, ``bind``, acks written behind, dedup."""

    # -- the contract -------------------------------------------------------------

    @pytest.mark.anyio
    async def test_a_dead_letter_store_is_what_replay_means(self, transport: Transport) -> None:
        """``capabilities.replay`` is claimed exactly by a :class:`DeadLetterStore`."""
        _check(
            isinstance(transport, DeadLetterStore),
            transport.capabilities.replay,
            "isinstance(transport, DeadLetterStore) (capabilities.replay)",
        )

    @pytest.mark.anyio
    async def test_bind_gives_the_bus_settings(self, transport: Transport) -> None:
        """``bind`` takes the bus's settings in one call; the codec only when given."""
        codec = transport.codec
        settings = TransportSettings(dead_letter_ttl=120.0, dead_letter_maxlen=7)
        transport.bind(settings)
        _check(transport.settings, settings, "transport.settings after bind")
        _check(transport.codec, codec, "codec after a bind without one")
        _check(transport.close_deadline, float("inf"), "close deadline after bind (a new life)")

    @pytest.mark.anyio
    async def test_acks_written_behind_reach_the_broker(self, transport: Transport) -> None:
        """An :class:`AcksWrittenBehind` transport's deliveries queue acks (``ack_nowait``)
        that are written within a moment: the group's backlog empties, nothing comes
        back, and no ack is reported unsettled."""
        if not isinstance(transport, AcksWrittenBehind):
            pytest.skip(f"{type(transport).__name__} awaits its acks")
        sent = _envelopes("behind", 5)
        async with transport.subscribe("behind", group="g", prefetch=5) as deliveries:
            await transport.publish("behind", sent)
            for _ in sent:
                delivery = await _next(deliveries, self.timeout, "a published envelope")
                assert delivery.acks_behind, f"{delivery!r} does not write its acks behind"
                delivery.ack_nowait()
                with pytest.raises(TransportError):
                    delivery.ack_nowait()
            if isinstance(transport, BacklogReader):
                await self._backlog_becomes(transport, "behind", "g", 0)
        async with transport.subscribe("behind", group="g", prefetch=5) as deliveries:
            with anyio.move_on_after(QUIET):
                extra = await anext(deliveries)
                raise AssertionError(f"an acked envelope came back: {extra.envelope!r}")
        _check(transport.unsettled_acks(), [], "acks reported unsettled")

    @pytest.mark.anyio
    async def test_dedup_store_claims_once(self, transport: Transport) -> None:
        """A :class:`DedupStoreProvider`'s store: one owner claims, others find it busy,
        then done; a released claim can be claimed again."""
        if not isinstance(transport, DedupStoreProvider):
            pytest.skip(f"{type(transport).__name__} keeps no dedup store")
        store = transport.dedup_store(60.0)
        assert isinstance(store, DedupStore), f"{store!r} is not a DedupStore"
        key, other = f"suite@g:{secrets.token_hex(6)}", f"suite@g:{secrets.token_hex(6)}"
        _check(await store.claim(key, "first", 30.0), Claim.CLAIMED, "the first claim")
        _check(await store.claim(key, "second", 30.0), Claim.BUSY, "a second owner's claim")
        _check(await store.extend(key, "first", 30.0), True, "the owner extends")
        _check(await store.extend(key, "second", 30.0), False, "another owner extends")
        await store.done(key, "first", 60.0)
        _check(await store.claim(key, "second", 30.0), Claim.DONE, "a claim once done")
        _check(await store.claim(other, "first", 30.0), Claim.CLAIMED, "another key")
        await store.release(other, "first")
        _check(await store.claim(other, "second", 30.0), Claim.CLAIMED, "a released key")
