"""Sample order: which dataset index each rank reads, epoch by epoch, and `RDSampler`.

Sits between the datasets (`datasets.py`) and training. A plain torch DataLoader takes
`RDSampler`; the dataflow's `MapDistributor` uses the same order functions. An epoch's
global order is a pure function of (seed, epoch, dataset length); global position p goes
to rank p % world_size, so a count of consumed positions resumes under any world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = [
    "RDSampler",
    "epoch_order",
    "epoch_end",
    "advance_position",
    "data_parallel_coordinates",
    "data_fingerprint",
    "check_state",
    "order_setup",
    "order_state",
]

STATE_VERSION = 1


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Dataset indices of one epoch in global order: a PCG64 permutation seeded by seed + epoch."""
    if not shuffle:
        return np.arange(num_items, dtype=np.int64)
    return np.random.Generator(np.random.PCG64(seed + epoch)).permutation(num_items)


def epoch_end(num_items: int, consumed: int, world_size: int, drop_last: bool) -> int:
    """Global end position (exclusive) of an epoch of which `consumed` positions are done.

    The remainder is cut (drop_last) or padded to a multiple of world_size; a padded position
    p >= num_items reads `order[p % num_items]`, a repeat of the epoch's first indices."""
    if not 0 <= consumed <= num_items:
        raise ValueError(f"consumed must be in [0, {num_items}], got {consumed}")
    left = num_items - consumed
    per_rank = left // world_size if drop_last else -(-left // world_size)
    return consumed + per_rank * world_size


def advance_position(
    epoch: int, consumed: int, steps: int, num_items: int, world_size: int, drop_last: bool
) -> tuple[int, int]:
    """(epoch, consumed) after every rank reads `steps` more items; an epoch's end gives (epoch + 1, 0)."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if drop_last and num_items < world_size:
        raise ValueError(f"drop_last with {num_items} items and {world_size} ranks leaves no items")
    while True:
        left = (epoch_end(num_items, consumed, world_size, drop_last) - consumed) // world_size
        if steps < left:
            return epoch, consumed + steps * world_size
        steps -= left
        epoch, consumed = epoch + 1, 0
        if steps == 0:
            return epoch, consumed


def data_parallel_coordinates(
    rank: int | None = None, world_size: int | None = None, process_group: Any = None
) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else torch.distributed when initialised, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(process_group) if rank is None else rank
        world_size = dist.get_world_size(process_group) if world_size is None else world_size
    elif process_group is not None:
        raise ValueError("process_group given but torch.distributed is not initialised")
    rank = 0 if rank is None else rank
    world_size = 1 if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size


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


class RDSampler(Sampler[int]):
    """Distributed, resumable sampler for a map-style dataset.

    Rank r reads global positions r, r + world_size, ... of the epoch's order. Resume is
    exact and O(1): call `advance(n)` with each step's local batch size, so the state counts
    what the training loop consumed (not what DataLoader workers prefetched). `start_iter`
    is the number of samples of `start_epoch` already consumed, counted over all ranks."""

    def __init__(
        self,
        dataset: Any,
        start_epoch: int = 0,
        start_iter: int = 0,
        seed: int = 42,
        drop_last: bool = False,
        shuffle: bool = True,
        process_group: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        self.num_items = len(dataset)
        self.fingerprint = data_fingerprint(dataset)
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.rank, self.world_size = data_parallel_coordinates(rank, world_size, process_group)
        if self.num_items == 0:
            raise ValueError("RDSampler needs a non-empty dataset")
        if start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {start_epoch}")
        self.epoch, self.consumed = start_epoch, 0
        self._set_consumed(start_iter)
        self._cache: tuple[int, np.ndarray] | None = None

    def _set_consumed(self, consumed: int) -> None:
        end = epoch_end(self.num_items, consumed, self.world_size, self.drop_last)
        self.consumed = consumed
        if end == consumed:  # nothing of this epoch is left for any rank
            self.epoch, self.consumed = self.epoch + 1, 0

    def _order(self) -> np.ndarray:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (
                self.epoch,
                epoch_order(self.num_items, self.seed, self.epoch, self.shuffle),
            )
        return self._cache[1]

    def _positions(self) -> np.ndarray:
        end = epoch_end(self.num_items, self.consumed, self.world_size, self.drop_last)
        return np.arange(self.consumed + self.rank, end, self.world_size)

    def __iter__(self) -> Iterator[int]:
        """This rank's remaining indices of the current epoch; iterating changes no state."""
        order = self._order()
        return iter(order[self._positions() % self.num_items].tolist())

    def __len__(self) -> int:
        return len(self._positions())

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the current epoch keeps its consumed count."""
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def advance(self, num_samples: int) -> None:
        """Record that every rank's training loop consumed `num_samples` more samples."""
        self.epoch, self.consumed = advance_position(
            self.epoch, self.consumed, num_samples, self.num_items, self.world_size, self.drop_last
        )

    def _setup(self) -> dict[str, Any]:
        return order_setup(self)

    def state_dict(self) -> dict[str, Any]:
        return order_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state("RDSampler", state, self._setup())
        self.epoch = int(state["epoch"])
        self._set_consumed(int(state["consumed"]))
