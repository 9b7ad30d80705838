"""Shards fetched ahead of a sample order: the positions a distributor reads next, mapped to
their items (`training.order.order_at`) and handed to the store, which has its shard source
fetch the shards holding them (`MmapStore.prefetch_items`). Nothing to do for shards on local
disk, nor for a source without prefetch threads."""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenmill.training.order import ShardLayout, order_at, worker_of

PREFETCH_POSITIONS = 128  # positions of the sample order whose shards are fetched ahead (0: off)
PREFETCH_EVERY = 32  # positions read between two looks ahead
PREFETCH_SHARE = 0.5  # of the cache limit, for the shards looked ahead at (all workers together)


def order_prefetch(
    dataset: Any,
    seed: int,
    shuffle: bool | str,
    share: tuple[int, int, int] | None = None,
    layout: ShardLayout | None = None,
) -> OrderPrefetch | None:
    """What fetches a dataset's shards ahead of its sample order (`training.order.order_at`),
    or None where there is nothing to fetch (shards on local disk, prefetch=0). `share`:
    (worker, workers, block) when a loader worker reads blocks worker, worker + workers, ...
    of the indices (`dataflow.distributors.worker_share`): each fetches ahead what it reads;
    block 0 (packing: every worker walks every index), worker 0 fetches ahead for all.
    `layout`: the shards' layout of `shuffle="shards"` (order.py)."""
    store = getattr(dataset, "store", None)
    source = getattr(store, "source", None)  # storage.source.ShardSource
    if PREFETCH_POSITIONS <= 0 or source is None or not source.prefetches:
        return None
    if not hasattr(store, "prefetch_items"):
        return None
    if share is not None and share[2] == 0:
        if share[0] != 0:
            return None
        share = None
    return OrderPrefetch(dataset, seed, shuffle, share or (0, 1, 1), layout)


def own_positions(positions: np.ndarray, given: int, share: tuple[int, int, int]) -> np.ndarray:
    """Those of the next `positions` (the order's, from the `given`-th index on) that fall to
    this worker under `share` (worker, workers, block), as `worker_share` deals them."""
    worker, workers, block = share
    return positions[worker_of(given + np.arange(len(positions)), block, workers) == worker]


class OrderPrefetch:
    """Called with each position a distributor reads; every `PREFETCH_EVERY` positions, looks at
    the next `PREFETCH_POSITIONS` positions that this worker reads and has the store fetch their
    items' shards ahead (`MmapStore.prefetch_items`), within `PREFETCH_SHARE` of the cache's limit;
    once every shard is known cached and none can be evicted, a call costs nothing."""

    def __init__(
        self,
        dataset: Any,
        seed: int,
        shuffle: bool | str,
        share: tuple[int, int, int],
        layout: ShardLayout | None = None,
    ) -> None:
        self.dataset, self.store, self.seed, self.shuffle = dataset, dataset.store, seed, shuffle
        self.layout = layout
        self.share, self.calls = share, 0  # calls: the indices the distributor gave so far
        self.n = len(dataset)
        self.next, self.epoch = 0, -1
        self.done = False

    def __call__(self, position: int, end: int, step: int, epoch: int) -> None:
        given, self.calls = self.calls, self.calls + 1
        if self.done or (epoch == self.epoch and position < self.next):
            return
        self.epoch, self.next = epoch, position + PREFETCH_EVERY * step
        if self.store.all_cached():
            self.done = True
            return
        positions = np.arange(position, min(end, position + PREFETCH_POSITIONS * step), step)
        positions = own_positions(positions, given, self.share)
        indices = order_at(positions, self.n, self.seed, epoch, self.shuffle, self.layout)
        ranges = self.dataset.item_ranges(indices)
        first, last = ranges if ranges is not None else (indices, None)
        stop = self.store.prefetch_items(first, last, PREFETCH_SHARE / self.share[1])  # per worker
        if stop is not None:  # the budget stopped it: look again halfway to that item
            self.next = position + max(1, stop * self.share[1] // 2) * step
