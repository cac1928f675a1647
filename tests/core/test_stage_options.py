"""What the subscriptions of one group share (their stage's options), and the clear
refusal of one that asks for different ones, in the direct and the decorator form."""

from __future__ import annotations

from typing import Any

import pytest

from asyncbus import Adaptive, Admission, Backpressure, Bus, ConfigurationError


async def handle(payload: Any) -> None:
    """A handler; the group is named explicitly in every test."""


FIRST: dict[str, Any] = {"capacity": 8, "backpressure": Backpressure.REJECT}

#: (first subscription's options, a joining one's, the refusal's text).
CONFLICTS = [
    pytest.param(
        {},
        {"capacity": 16},
        "already has capacity=8, backpressure=REJECT; a subscription in the same group "
        "asked for capacity=16, backpressure=REJECT",
        id="capacity",
    ),
    pytest.param(
        {},
        {"backpressure": Backpressure.BLOCK},
        "asked for capacity=8, backpressure=BLOCK",
        id="backpressure",
    ),
    pytest.param(
        {"admission": Admission()},
        {},
        "already has admission=Admission(",
        id="admission",
    ),
    pytest.param({}, {"max_in_flight": 3}, "already has max_in_flight=None", id="max_in_flight"),
    pytest.param(
        {"ordering": "key"},
        {"ordering": "key", "key_failure": "stop"},
        "already has ordering='key', key_failure='continue'; a subscription in the same "
        "group asked for ordering='key', key_failure='stop'",
        id="key_failure",
    ),
    pytest.param(
        {},
        {"concurrency": Adaptive(min=1, max=4)},
        "runs a fixed concurrency; a subscription in the same group cannot be Adaptive",
        id="adaptive",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("first", "joining", "refusal"), CONFLICTS)
def test_a_subscription_asking_for_other_stage_options_is_refused_in_both_forms(
    first: dict[str, Any], joining: dict[str, Any], refusal: str
) -> None:
    bus = Bus()
    bus.subscribe("orders", handle, group="g", **{**FIRST, **first})
    options = {**FIRST, **joining}
    with pytest.raises(ConfigurationError, match="stage 'orders@g' ") as direct:
        bus.subscribe("orders", handle, group="g", **options)
    assert refusal in str(direct.value)
    with pytest.raises(ConfigurationError) as decorated:
        bus.subscribe("orders", group="g", **options)  # refused before a handler is given
    assert str(decorated.value) == str(direct.value)
    assert len(bus.statistics().stages) == 1  # nothing was added


@pytest.mark.timeout(10)
def test_the_same_stage_options_join_and_each_subscription_keeps_its_own_chain() -> None:
    bus = Bus()
    first = bus.subscribe("orders", handle, group="g", timeout=1.0, **FIRST)
    second = bus.subscribe("orders", handle, group="g", concurrency=3, **FIRST)
    assert first.stage_options == second.stage_options
    assert (second.capacity, second.backpressure) == (8, Backpressure.REJECT)
    assert (second.admission, second.ordering, second.key_failure) == (None, None, "continue")
    assert (second.max_in_flight, second.partitions) == (None, None)
    assert (first.timeout, first.concurrency) == (1.0, 1)
    assert (second.timeout, second.concurrency) == (None, 3)
    (stage,) = bus.statistics().stages
    assert stage.name == "orders@g"


@pytest.mark.timeout(10)
def test_an_adaptive_group_takes_fixed_and_adaptive_subscriptions() -> None:
    bus = Bus()
    bus.subscribe("orders", handle, group="g", concurrency=Adaptive(min=1, max=4))
    bus.subscribe("orders", handle, group="g", concurrency=2)
    bus.subscribe("orders", handle, group="g", concurrency=Adaptive(min=1, max=8))
    assert len(bus.statistics().stages) == 1
