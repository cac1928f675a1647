"""The envelopes and receipts the hot path builds are ordinary frozen dataclass instances."""

from __future__ import annotations

import dataclasses
import itertools
import math
import pickle
import random
from bisect import bisect_right

import pytest

from asyncbus import Envelope, Receipt, _envelope, _stats
from asyncbus._envelope import (
    EMPTY_HEADERS,
    make_envelope,
    make_envelopes,
    make_receipt,
    make_receipts,
    new_id,
)

pytestmark = pytest.mark.timeout(10)


def test_built_envelopes_are_frozen_dataclass_envelopes() -> None:
    built = make_envelopes("t", [1, {"a": 2}], EMPTY_HEADERS, 5.0, 9.0, ("s",), None, "bus")
    assert [type(envelope) for envelope in built] == [Envelope, Envelope]
    first = built[0]
    assert first == Envelope(
        id=first.id, topic="t", payload=1, timestamp=5.0, ttl=9.0, slip=("s",), sender="bus"
    )
    assert first.correlation_id == first.id
    assert first.causation_id is None
    assert first.attempt == 1
    assert first.reply_to is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.topic = "other"  # type: ignore[misc]
    assert dataclasses.replace(first, attempt=2).attempt == 2
    assert pickle.loads(pickle.dumps(built[1])) == built[1]


def test_built_envelopes_continue_a_conversation() -> None:
    built = make_envelopes("t", range(3), EMPTY_HEADERS, 1.0, None, (), ("corr", "cause"), None)
    assert [(e.correlation_id, e.causation_id, e.payload) for e in built] == [
        ("corr", "cause", 0),
        ("corr", "cause", 1),
        ("corr", "cause", 2),
    ]


def test_single_envelope_and_receipts_are_dataclass_instances() -> None:
    single = make_envelope("i", "t", 3, EMPTY_HEADERS, 1.0, None, 2, (), "c", None, None, None)
    assert type(single) is Envelope
    assert single == Envelope(
        id="i", topic="t", payload=3, timestamp=1.0, attempt=2, correlation_id="c"
    )
    receipt = make_receipt("i", ("a@g",), (), ("b@g",))
    assert type(receipt) is Receipt
    assert receipt == Receipt("i", ("a@g",), (), ("b@g",))
    assert not receipt
    receipts = make_receipts([single, single], ("a@g",))
    assert receipts == [Receipt("i", ("a@g",)), Receipt("i", ("a@g",))]
    assert all(type(r) is Receipt and r for r in receipts)


def test_batch_ids_match_new_id_and_sort_across_runs_of_256() -> None:
    before = new_id()
    built = make_envelopes("t", range(700), EMPTY_HEADERS, 1.0, None, (), None, None)
    after = new_id()
    ids = [envelope.id for envelope in built]
    assert len(set(ids)) == 700
    assert all(len(i) == 26 and i.endswith(_envelope._node) for i in ids)
    assert before < ids[0] and ids == sorted(ids) and ids[-1] < after
    # Consecutive ids differ by one in their 20 digits of stamp (a run of 256 carries).
    stamps = [int(i[:20], 16) for i in ids]
    assert [b - a for a, b in itertools.pairwise(stamps)] == [1] * 699


def test_histogram_buckets_are_the_logarithms_buckets() -> None:
    rng = random.Random(7)
    for _ in range(20_000):
        seconds = 10 ** rng.uniform(-8, 5)
        expected = (
            0
            if seconds <= _stats._SMALLEST
            else min(
                int(math.log2(seconds / _stats._SMALLEST) * _stats._STEPS_PER_OCTAVE) + 1,
                _stats._BUCKETS - 1,
            )
        )
        found = bisect_right(_stats._EDGES, seconds) if seconds > _stats._SMALLEST else 0
        assert found == expected
