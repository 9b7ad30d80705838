"""Resume state, shared by RDSampler and the dataflow's roles: a version and a setup, checked.

A state carries its version and the setup it was saved under (seed, shuffle, drop_last, the
data's fingerprint; with `shuffle="shards"` also the canonical group count and the window)
beside its position (order.py: an epoch and a count of consumed positions), and refuses to
load under another one, naming the field and both values.
"""

from __future__ import annotations

from typing import Any

from tokenmill.training.order import (
    ShardLayout,
    advance_position,
    data_parallel_coordinates,
    epoch_end,
    epoch_order,
    order_at,
    order_blocks,
    shard_bounds,
    worker_of,
)

__all__ = [  # the order's names too, where their users have always found them
    "SHUFFLES",
    "STATE_VERSION",
    "ShardLayout",
    "adopt_groups",
    "advance_position",
    "check_shuffle",
    "check_state",
    "state_count",
    "data_fingerprint",
    "data_parallel_coordinates",
    "epoch_end",
    "epoch_order",
    "order_at",
    "order_blocks",
    "order_setup",
    "order_layout",
    "order_state",
    "shard_bounds",
    "worker_of",
]

STATE_VERSION = 2  # 2: the per-position order (order_at) replaced a PCG64 permutation
SHUFFLES = (True, False, "shards")  # global permutation, none, shard-aware (order.py)


def data_fingerprint(dataset: Any) -> str:
    """The dataset's own `fingerprint`, else its length: resume state stores it."""
    fingerprint = getattr(dataset, "fingerprint", None)
    return str(fingerprint) if fingerprint else f"len={len(dataset)}"


def check_state(owner: str, state: dict, expected: dict[str, Any]) -> None:
    """Refuse a state saved under another setup, naming the field and both values."""
    if not isinstance(state, dict):
        raise TypeError(f"{owner}: state must be a dict, got {type(state).__name__}")
    expected = {"version": STATE_VERSION, **expected}
    for key, now in expected.items():
        if key not in state:
            raise ValueError(f"{owner} cannot resume: state lacks {key!r}")
        if state[key] != now:
            raise ValueError(f"{owner} cannot resume: {key}: saved {state[key]!r}, now {now!r}")


def state_count(owner: str, state: dict, key: str, high: int | None = None) -> int:
    """`state[key]`, a count: an integer (a bool is not one here) in [0, high], else a
    ValueError naming the field (an edited state must not skip or repeat a sample)."""
    if key not in state:
        raise ValueError(f"{owner} cannot resume: state lacks {key!r}")
    value = state[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{owner} cannot resume: {key} must be an integer, got {type(value).__name__} {value!r}"
        )
    if value < 0 or (high is not None and value > high):
        bound = f"[0, {high}]" if high is not None else ">= 0"
        raise ValueError(f"{owner} cannot resume: {key} {value} is outside {bound}")
    return value


def check_shuffle(owner: str, shuffle: Any, canonical_groups: Any, shard_window: Any) -> None:
    """`shuffle` is one of SHUFFLES, and the shard-aware order's settings are positive ints."""
    if not (isinstance(shuffle, bool) or shuffle == "shards"):
        raise ValueError(f"{owner}: shuffle must be True, False or 'shards', got {shuffle!r}")
    for name, value in (("canonical_groups", canonical_groups), ("shard_window", shard_window)):
        if value is None and name == "canonical_groups":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


def order_setup(owner: Any) -> dict[str, Any]:
    """What an order's state is valid under (checked on load): seed, shuffle, drop_last, data;
    for the shard-aware order also its canonical group count and window."""
    setup = {
        "seed": owner.seed,
        "shuffle": owner.shuffle,
        "drop_last": owner.drop_last,
        "fingerprint": owner.fingerprint,
    }
    if owner.shuffle == "shards":
        setup["canonical_groups"] = owner.canonical_groups
        setup["shard_window"] = owner.shard_window
    return setup


def adopt_groups(owner: Any, state: dict[str, Any]) -> None:
    """A shard-aware order whose canonical group count was not given takes the saved one: the
    count is fixed at a run's first start, whatever world size resumes it (None: not yet)."""
    if owner.shuffle == "shards" and not owner.groups_given and isinstance(state, dict):
        saved = state.get("canonical_groups")
        if saved is None or (isinstance(saved, int) and not isinstance(saved, bool) and saved > 0):
            owner.canonical_groups = saved


def order_layout(owner: Any) -> ShardLayout | None:
    """The owner's ShardLayout for `shuffle="shards"`, from its `bounds` (`shard_bounds` of its
    dataset) and its canonical_groups, which must be fixed by now; None for other orders."""
    if owner.shuffle != "shards":
        return None
    layout = owner._layout
    if layout is None or layout.groups != owner.canonical_groups:
        layout = owner._layout = ShardLayout(
            owner.bounds, owner.canonical_groups, owner.shard_window
        )
    return layout


def order_state(owner: Any) -> dict[str, Any]:
    """The resume state of an epoch order: its setup, the epoch, and the global consumed count."""
    return {
        "version": STATE_VERSION,
        **order_setup(owner),
        "epoch": owner.epoch,
        "consumed": owner.consumed,
    }
