"""``Bus`` shows DESIGN's surface and what the guide documents, and nothing else."""

from __future__ import annotations

from asyncbus import Bus

#: DESIGN's methods, plus ``running`` and ``subscribed()`` (documented in the guide),
#: ``publish_many`` (the README and the guide), ``delete_group`` (beside ``groups``) and
#: ``cluster_statistics`` (the guide's In production chapter); time: ``cancel_scheduled``,
#: ``scheduled``, ``schedule`` and ``periodic`` (DESIGN's names fixed by the time issue).
DOCUMENTED_METHODS = {
    "aclose",
    "cancel_scheduled",
    "periodic",
    "schedule",
    "scheduled",
    "cluster_statistics",
    "delete_group",
    "drain",
    "groups",
    "publish",
    "publish_many",
    "publish_nowait",
    "publish_threadsafe",
    "request",
    "running",
    "statistics",
    "subscribe",
    "subscribed",
}
#: Attributes of an instance: DESIGN's ``dead_letters`` and what the constructor was given.
DOCUMENTED_ATTRIBUTES = {"dead_letters", "name", "transport", "workers"}


def test_the_class_has_only_the_documented_public_names() -> None:
    assert {name for name in dir(Bus) if not name.startswith("_")} == DOCUMENTED_METHODS


def test_an_instance_has_only_the_documented_public_names() -> None:
    bus = Bus(workers=2, name="svc")
    public = {name for name in dir(bus) if not name.startswith("_")}
    assert public == DOCUMENTED_METHODS | DOCUMENTED_ATTRIBUTES
    assert (bus.name, bus.workers, bus.transport) == ("svc", 2, None)


def test_subscribe_takes_a_batch_in_every_form() -> None:
    import inspect
    import typing

    forms = [*typing.get_overloads(Bus.subscribe), Bus.subscribe]
    assert len(forms) == 3
    for form in forms:
        parameter = inspect.signature(form).parameters["batch"]
        assert (parameter.kind, parameter.default) == (inspect.Parameter.KEYWORD_ONLY, None)
        assert parameter.annotation == "Batch | None"
