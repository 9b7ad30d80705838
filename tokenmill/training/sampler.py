"""RDSampler: the sample order for a plain torch DataLoader, resumable exactly once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from tokenmill.training.state import (
    advance_position,
    check_state,
    data_fingerprint,
    data_parallel_coordinates,
    epoch_end,
    order_blocks,
    order_setup,
    order_state,
)


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

    def _set_consumed(self, consumed: int) -> None:
        end = epoch_end(self.num_items, consumed, self.world_size, self.drop_last)
        self.consumed = consumed
        if end == consumed:  # nothing of this epoch is left for any rank
            self.epoch, self.consumed = self.epoch + 1, 0

    def __iter__(self) -> Iterator[int]:
        """This rank's remaining indices of the current epoch; iterating changes no state."""
        end = epoch_end(self.num_items, self.consumed, self.world_size, self.drop_last)
        return order_blocks(
            self.consumed + self.rank, end, self.world_size, self.num_items, self.seed,
            self.epoch, self.shuffle,
        )  # fmt: skip

    def __len__(self) -> int:
        end = epoch_end(self.num_items, self.consumed, self.world_size, self.drop_last)
        return len(range(self.consumed + self.rank, end, self.world_size))

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
