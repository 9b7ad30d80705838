"""Resume state, shared by RDSampler and the dataflow's roles: a version and a setup, checked.

A state carries its version and the setup it was saved under (seed, shuffle, drop_last, the
data's fingerprint) beside its position (order.py: an epoch and a count of consumed
positions), and refuses to load under another one, naming the field and both values.
"""

from __future__ import annotations

from typing import Any

from tokenmill.training.order import (
    advance_position,
    data_parallel_coordinates,
    epoch_end,
    epoch_order,
    order_at,
    order_blocks,
    worker_of,
)

__all__ = [  # the order's names too, where their users have always found them
    "STATE_VERSION",
    "advance_position",
    "check_state",
    "data_fingerprint",
    "data_parallel_coordinates",
    "epoch_end",
    "epoch_order",
    "order_at",
    "order_blocks",
    "order_setup",
    "order_state",
    "worker_of",
]

STATE_VERSION = 2  # 2: the per-position order (order_at) replaced a PCG64 permutation


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


def order_setup(owner: Any) -> dict[str, Any]:
    """What an order's state is valid under (checked on load): seed, shuffle, drop_last, data."""
    return {
        "seed": owner.seed,
        "shuffle": owner.shuffle,
        "drop_last": owner.drop_last,
        "fingerprint": owner.fingerprint,
    }


def order_state(owner: Any) -> dict[str, Any]:
    """The resume state of an epoch order: its setup, the epoch, and the global consumed count."""
    return {
        "version": STATE_VERSION,
        **order_setup(owner),
        "epoch": owner.epoch,
        "consumed": owner.consumed,
    }
