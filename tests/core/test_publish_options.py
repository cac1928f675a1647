"""A publish's options travel as one value, made once where the bus's method is called."""

from __future__ import annotations

from asyncbus._options import PLAIN, PublishOptions, make_options, publish_options


def test_a_publish_without_options_is_the_one_plain_value() -> None:
    assert publish_options(None, None, (), None, None, None, None) is PLAIN
    # Empty headers and an empty slip are no options either, as they were before.
    assert publish_options({}, None, [], None, None, None, None) is PLAIN


def test_the_fast_constructor_makes_the_same_value_as_the_named_tuple() -> None:
    given = ({"a": "b"}, 1.5, ("next",), "k", "id-1", 2.0, 1)
    made = make_options(given)
    assert type(made) is PublishOptions
    assert made == PublishOptions(*given)
    assert (made.headers, made.ttl, made.slip, made.key, made.id, made.timeout, made.priority) == (
        given
    )
    assert publish_options(*given) == made
