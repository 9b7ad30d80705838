"""RDSampler: the sample order for a plain torch DataLoader, resumable exactly once.

Two ways to resume exactly, and no third: in a plain DataLoader the training loop calls
`advance(n)` after each step (workers prefetch indices, so what the sampler handed out is not
what was trained); in torchdata's StatefulDataLoader the loader checkpoints the sampler's
iterator itself (`OrderIterator` is Stateful), matched to the batches it returned. A state
saved by a loop that did neither would repeat samples on resume, and is refused there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from tokenmill.training.order import (
    advance_position,
    data_parallel_coordinates,
    epoch_end,
    order_blocks,
)
from tokenmill.training.order_prefetch import order_prefetch
from tokenmill.training.state import (
    ShardLayout,
    adopt_groups,
    check_shuffle,
    check_state,
    data_fingerprint,
    order_layout,
    order_setup,
    order_state,
    shard_bounds,
    state_count,
)


class RDSampler(Sampler[int]):
    """Distributed, resumable sampler for a map-style dataset.

    Rank r reads global positions r, r + world_size, ... of the epoch's order. Resume is
    exact and O(1): call `advance(n)` with each step's local batch size, so the state counts
    what the training loop consumed (not what DataLoader workers prefetched); or use it in
    torchdata's StatefulDataLoader, which checkpoints its iterator. `start_iter` is the number
    of samples of `start_epoch` already consumed, counted over all ranks. Call
    `set_epoch(e)` at the start of each epoch, as with torch's DistributedSampler.

    `shuffle="shards"`: the shard-aware order (training.order.shard_order_at), for data read
    from a bucket through a cache smaller than it: `canonical_groups` (default: this world
    size; a resume takes the saved one) streams of shards, each read a window of
    `shard_window` shards at a time. Rank r then reads only streams r, r + world_size, ...
    where the world size divides `canonical_groups`."""

    def __init__(
        self,
        dataset: Any,
        start_epoch: int = 0,
        start_iter: int = 0,
        seed: int = 42,
        drop_last: bool = False,
        shuffle: bool | str = True,
        process_group: Any = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        canonical_groups: int | None = None,
        shard_window: int = 4,
    ) -> None:
        self.num_items = len(dataset)
        self.dataset = dataset  # in a bucket: its shards are fetched ahead of the order
        self.fingerprint = data_fingerprint(dataset)
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.rank, self.world_size = data_parallel_coordinates(rank, world_size, process_group)
        if self.num_items == 0:
            raise ValueError("RDSampler needs a non-empty dataset")
        if start_epoch < 0:
            raise ValueError(f"start_epoch must be >= 0, got {start_epoch}")
        check_shuffle("RDSampler", shuffle, canonical_groups, shard_window)
        self.groups_given = canonical_groups is not None
        shards = shuffle == "shards"
        self.canonical_groups = canonical_groups or (self.world_size if shards else None)
        self.shard_window = shard_window
        self.bounds = shard_bounds(dataset) if shards else None  # refused here if unknown
        self._layout: ShardLayout | None = None
        self.epoch, self.consumed = start_epoch, 0
        self._set_consumed(start_iter)
        self.handed_out = self.consumed  # global position the last iterator reached
        self.advanced = False  # advance() called since the epoch began
        self._unpositioned: int | None = None  # samples a plain resume would repeat

    def _set_consumed(self, consumed: int) -> None:
        end = epoch_end(self.num_items, consumed, self.world_size, self.drop_last)
        self.consumed = consumed
        if end == consumed:  # nothing of this epoch is left for any rank
            self.epoch, self.consumed = self.epoch + 1, 0

    def __iter__(self) -> OrderIterator:
        """This rank's remaining indices of the current epoch; iterating changes only
        `handed_out`, never the position a state resumes from."""
        return OrderIterator(self)

    def __len__(self) -> int:
        end = epoch_end(self.num_items, self.consumed, self.world_size, self.drop_last)
        return len(range(self.consumed + self.rank, end, self.world_size))

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; the current epoch keeps its consumed count."""
        if epoch != self.epoch:
            self.epoch, self.consumed, self.handed_out, self.advanced = epoch, 0, 0, False

    def advance(self, num_samples: int) -> None:
        """Record that every rank's training loop consumed `num_samples` more samples."""
        epoch = self.epoch
        self.epoch, self.consumed = advance_position(
            self.epoch, self.consumed, num_samples, self.num_items, self.world_size, self.drop_last
        )
        self.advanced = True
        if self.epoch != epoch:  # the iterator that handed out the old epoch is done
            self.handed_out = self.consumed

    def _setup(self) -> dict[str, Any]:
        return order_setup(self)

    def state_dict(self) -> dict[str, Any]:
        return {**order_state(self), "handed_out": self.handed_out, "advanced": self.advanced}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        adopt_groups(self, state)
        check_state("RDSampler", state, self._setup())
        end = epoch_end(self.num_items, 0, self.world_size, self.drop_last)
        epoch = state_count("RDSampler", state, "epoch")
        consumed = state_count("RDSampler", state, "consumed", min(end, self.num_items))
        handed_out = (
            state_count("RDSampler", state, "handed_out", end)
            if "handed_out" in state
            else consumed
        )
        if not isinstance(state.get("advanced", False), bool):
            raise ValueError(
                f"RDSampler cannot resume: advanced must be a bool, got {state['advanced']!r}"
            )
        if consumed > handed_out:  # consumed past what was handed out: samples never trained
            raise ValueError(
                f"RDSampler cannot resume: consumed {consumed} is past handed_out {handed_out}: "
                f"it would skip {consumed - handed_out} sample(s)"
            )
        self.epoch = epoch
        self._set_consumed(consumed)
        unconsumed = handed_out - consumed
        # handed out, never advanced: unless a StatefulDataLoader positions the iterator
        # next (it loads the iterator's own state), a resume would repeat those samples
        self._unpositioned = (
            unconsumed if unconsumed > 0 and not state.get("advanced", True) else None
        )
        self.handed_out, self.advanced = self.consumed, bool(state.get("advanced", False))

    def _refuse_unpositioned(self) -> None:
        if self._unpositioned:
            raise RuntimeError(
                f"RDSampler: this state was saved by a training loop that never called "
                f"advance(): resuming from it would repeat {self._unpositioned} samples. Call "
                "sampler.advance(local_batch_size) after each step in a plain DataLoader, or "
                "use torchdata's StatefulDataLoader, which checkpoints the sampler's iterator"
            )


class OrderIterator(Iterator[int]):
    """An RDSampler's indices from its position on; Stateful (state_dict/load_state_dict), so
    torchdata's StatefulDataLoader checkpoints exactly the indices behind the batches it
    returned, whatever its workers prefetched."""

    def __init__(self, sampler: RDSampler) -> None:
        self.sampler = sampler
        self._start(sampler.epoch, sampler.consumed)

    def _start(self, epoch: int, consumed: int) -> None:
        s = self.sampler
        self.epoch, self.start, self.yielded = epoch, consumed, 0
        self.end = epoch_end(s.num_items, consumed, s.world_size, s.drop_last)
        layout = order_layout(s)
        self._indices = order_blocks(
            consumed + s.rank, self.end, s.world_size, s.num_items, s.seed, epoch, s.shuffle,
            layout=layout,
        )  # fmt: skip
        self._prefetch = order_prefetch(s.dataset, s.seed, s.shuffle, layout=layout)

    def __next__(self) -> int:
        if self.yielded == 0:
            self.sampler._refuse_unpositioned()
        index = next(self._indices)
        if self._prefetch is not None:
            self._prefetch(
                self.position + self.sampler.rank, self.end, self.sampler.world_size, self.epoch
            )
        self.yielded += 1
        if self.sampler.epoch == self.epoch:
            self.sampler.handed_out = max(self.sampler.handed_out, self.position)
        return index

    @property
    def position(self) -> int:
        """The global count of the epoch's positions behind the indices handed out."""
        return self.start + self.yielded * self.sampler.world_size

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = self.sampler
        if not isinstance(state, dict):
            raise TypeError(f"RDSampler iterator: state must be a dict, got {type(state).__name__}")
        end = epoch_end(s.num_items, 0, s.world_size, s.drop_last)
        epoch = state_count("RDSampler iterator", state, "epoch")
        position = state_count("RDSampler iterator", state, "position", end)
        s.epoch, s.consumed, s.handed_out, s._unpositioned = epoch, position, position, None
        self._start(epoch, position)
