"""Edited resume states (issue 39): each field is checked, the field named; a state that would
skip or repeat a sample is refused, never loaded."""

from __future__ import annotations

import pytest

from tokenmill.training.sampler import RDSampler


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _saved(n: int = 100, consumed: int = 40) -> dict:
    """A state saved after `consumed` samples were trained, as a training loop saves it."""
    sampler = RDSampler(Sized(n), seed=1)
    it = iter(sampler)
    for _ in range(consumed):
        next(it)
    sampler.advance(consumed)
    return sampler.state_dict()


def _resumed(state: dict) -> list[int]:
    sampler = RDSampler(Sized(100), seed=1)
    sampler.load_state_dict(state)
    return list(sampler)


def test_an_untouched_state_resumes_exactly_where_training_stopped():
    full = list(RDSampler(Sized(100), seed=1))
    assert _resumed(_saved()) == full[40:]


def test_consumed_raised_past_what_was_handed_out_is_refused_not_a_skipped_sample():
    """The issue's 40 -> 41: sample 41 was never trained; loading it would skip it."""
    state = {**_saved(), "consumed": 41}
    with pytest.raises(ValueError, match="consumed 41 is past handed_out 40: it would skip 1"):
        _resumed(state)


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("consumed", True, "consumed must be an integer, got bool True"),
        ("consumed", 40.0, "consumed must be an integer, got float 40.0"),
        ("consumed", "40", "consumed must be an integer, got str '40'"),
        ("consumed", None, "consumed must be an integer, got NoneType None"),
        ("consumed", -1, "consumed -1 is outside [0, 100]"),
        ("consumed", 101, "consumed 101 is outside [0, 100]"),
        ("epoch", -1, "epoch -1 is outside >= 0"),
        ("epoch", "0", "epoch must be an integer, got str '0'"),
        ("epoch", False, "epoch must be an integer, got bool False"),
        ("handed_out", [40], "handed_out must be an integer, got list [40]"),
        ("handed_out", 1000, "handed_out 1000 is outside [0, 100]"),
        ("advanced", "yes", "advanced must be a bool, got 'yes'"),
    ],
)
def test_a_wrongly_typed_or_out_of_range_field_is_refused_naming_it(field, value, said):
    """Each of the fields a person can edit: a ValueError naming the field and the value,
    not a bare TypeError/KeyError/ValueError from deep inside, and nothing loaded."""
    with pytest.raises(ValueError, match="RDSampler cannot resume: " + said.replace("[", r"\[")):
        _resumed({**_saved(), field: value})


@pytest.mark.parametrize("field", ["epoch", "consumed"])
def test_a_missing_field_is_named(field):
    state = _saved()
    del state[field]
    with pytest.raises(ValueError, match=f"RDSampler cannot resume: state lacks '{field}'"):
        _resumed(state)


def test_the_iterators_own_state_is_checked_field_by_field():
    """StatefulDataLoader's checkpoint of the sampler's iterator: the same checks."""
    sampler = RDSampler(Sized(100), seed=1)
    it = iter(sampler)
    for state, said in [
        ({"epoch": 0, "position": True}, "position must be an integer, got bool"),
        ({"epoch": -2, "position": 3}, "epoch -2 is outside >= 0"),
        ({"epoch": 0, "position": 101}, r"position 101 is outside \[0, 100\]"),
        ({"epoch": 0}, "state lacks 'position'"),
    ]:
        with pytest.raises(ValueError, match="RDSampler iterator cannot resume: " + said):
            it.load_state_dict(state)
    it.load_state_dict({"epoch": 0, "position": 7})
    assert list(it) == list(RDSampler(Sized(100), seed=1))[7:]


def test_map_distributor_state_fields_are_checked():
    from tokenmill.training.state import state_count

    with pytest.raises(ValueError, match="MapDistributor cannot resume: consumed must be an int"):
        state_count("MapDistributor", {"consumed": True}, "consumed", 10)
    assert state_count("MapDistributor", {"consumed": 10}, "consumed", 10) == 10
