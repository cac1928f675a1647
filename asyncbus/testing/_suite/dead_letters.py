"""The suite's tests of the dead-letter store, and of the store every process
shares (taking is a claim, watchers hear of each change)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
import pytest

from ..._dead_letters import DeadLetter, DeadLetterReason, dead_letter_key
from ..._envelope import Envelope
from ...transports.base import DeadLetterChange, SharedDeadLetters, Transport, TransportSettings
from .base import SuiteBase
from .support import _check, _check_envelope, _ids


class DeadLetterTests(SuiteBase):
    """The dead-letter store, and the store every process shares."""

    # -- the dead-letter store ------------------------------------------------------

    def _dead_letter(self, payload: Any, *, dead_at: float | None = None) -> DeadLetter:
        envelope = Envelope(topic="dead.stored", payload=payload, headers={"why": "ü"})
        return DeadLetter(
            envelope,
            DeadLetterReason.EXPIRED,
            None,
            "dead.*@g",
            3,
            time.time() if dead_at is None else dead_at,
        )

    @pytest.mark.anyio
    async def test_added_dead_letters_are_listed_oldest_first(self, transport: Transport) -> None:
        """``add_dead_letter`` entries come back from ``dead_letters`` in order, intact."""
        store = self._store(transport)
        now = time.time()
        added = [self._dead_letter({"n": n}, dead_at=now - 10 + n) for n in range(3)]
        for entry in added:
            await store.add_dead_letter(entry)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), _ids(e.envelope for e in added), "ids")
        for got, want in zip(listed, added, strict=True):
            _check_envelope(got.envelope, want.envelope, attempt=want.envelope.attempt)
            for name in ("reason", "error", "stage", "attempts"):
                _check(getattr(got, name), getattr(want, name), f"dead letter {name}")
            assert abs(got.dead_at - want.dead_at) < 1e-3, f"dead_at {got.dead_at}"

    @pytest.mark.anyio
    async def test_remove_dead_letters_forgets_those_ids(self, transport: Transport) -> None:
        """``remove_dead_letters`` drops the given ids, keeps the others; no ids: none."""
        store = self._store(transport)
        added = [self._dead_letter(n) for n in range(3)]
        for entry in added:
            await store.add_dead_letter(entry)
        await store.remove_dead_letters([])
        _check(len(await store.dead_letters()), 3, "dead letters after removing none")
        await store.remove_dead_letters([added[0].envelope.id, added[2].envelope.id])
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [added[1].envelope.id], "remaining ids")
        await store.remove_dead_letters(["no-such-id"])
        _check(len(await store.dead_letters()), 1, "dead letters after an unknown id")

    @pytest.mark.anyio
    async def test_dead_letters_past_their_ttl_are_dropped(self, transport: Transport) -> None:
        """Entries older than the bound ``dead_letter_ttl`` are no longer listed."""
        store = self._store(transport)
        transport.bind(TransportSettings(dead_letter_ttl=60.0))
        old = self._dead_letter("old", dead_at=time.time() - 120)
        young = self._dead_letter("young")
        await store.add_dead_letter(old)
        await store.add_dead_letter(young)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [young.envelope.id], "ids within the ttl")

    @pytest.mark.anyio
    async def test_dead_letters_beyond_maxlen_drop_the_oldest(self, transport: Transport) -> None:
        """At most the bound ``dead_letter_maxlen`` entries are kept, the newest ones."""
        store = self._store(transport)
        transport.bind(TransportSettings(dead_letter_maxlen=2))
        added = [self._dead_letter(n) for n in range(4)]
        for entry in added:
            await store.add_dead_letter(entry)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), _ids(e.envelope for e in added[2:]), "ids kept")

    # -- a store every process shares ---------------------------------------------

    def _shared(self, transport: Transport) -> SharedDeadLetters:
        """The transport as :class:`SharedDeadLetters` (the test is skipped otherwise)."""
        if not isinstance(transport, SharedDeadLetters):
            pytest.skip(f"{type(transport).__name__} shares no dead letters")
        return transport

    @pytest.mark.anyio
    async def test_taking_dead_letters_is_a_claim(self, transport: Transport) -> None:
        """Of concurrent ``take_dead_letters`` of one id, one gets each of its entries
        (every stage's), once; the other gets none; what was not asked for stays."""
        shared = self._shared(transport)
        store = self._store(transport)
        wanted = self._dead_letter("twice")
        other_stage = dataclasses.replace(wanted, stage="dead.stored@other")
        kept = self._dead_letter("kept")
        for entry in (wanted, other_stage, kept):
            await store.add_dead_letter(entry)
        takes: list[list[DeadLetter]] = []

        async def take() -> None:
            takes.append(await shared.take_dead_letters([wanted.envelope.id]))

        with anyio.fail_after(self.timeout):
            async with anyio.create_task_group() as group:
                for _ in range(3):
                    group.start_soon(take)
        got = sorted(entry.stage or "" for taken in takes for entry in taken)
        _check(got, ["dead.*@g", "dead.stored@other"], "stages taken, over three takes")
        _check(sorted(len(taken) for taken in takes), [0, 0, 2], "entries per take")
        (winner,) = [taken for taken in takes if taken]
        _check_envelope(winner[0].envelope, wanted.envelope, attempt=None)
        listed = await store.dead_letters()
        _check(_ids(e.envelope for e in listed), [kept.envelope.id], "ids left")
        _check(await shared.take_dead_letters(["no-such-id"]), [], "take of an unknown id")

    @pytest.mark.anyio
    async def test_watchers_hear_of_every_change(self, transport: Transport) -> None:
        """A watcher is told of each entry added and taken out (by its key), and to read
        the store again after a purge of everything or entries put back."""
        shared = self._shared(transport)
        store = self._store(transport)
        entry = self._dead_letter("watched")
        key = dead_letter_key(entry)
        async with shared.watch_dead_letters() as changes:

            async def next_change(what: str) -> DeadLetterChange:
                try:
                    with anyio.fail_after(self.timeout):
                        return await anext(changes)
                except TimeoutError:
                    raise AssertionError(f"no change within {self.timeout} s: {what}") from None

            await store.add_dead_letter(entry)
            added = await next_change("the entry added")
            _check([dead_letter_key(e) for e in added.added], [key], "keys added")
            _check_envelope(added.added[0].envelope, entry.envelope, attempt=None)
            (taken,) = await shared.take_dead_letters([entry.envelope.id])
            removed = await next_change("the entry taken")
            _check((list(removed.removed), removed.stale), ([key], False), "keys removed")

            async def until_stale(what: str) -> None:
                change = await next_change(what)
                while not change.stale:  # (an addition may come first)
                    _check(change.removed, (), f"keys removed before: {what}")
                    change = await next_change(what)

            await shared.restore_dead_letters([taken])
            await until_stale("read again, after the entry was put back")
            listed = await store.dead_letters()
            _check(_ids(e.envelope for e in listed), [entry.envelope.id], "ids put back")
            await shared.clear_dead_letters()
            await until_stale("read again, after a purge of everything")
            _check(await store.dead_letters(), [], "dead letters after a purge of everything")
