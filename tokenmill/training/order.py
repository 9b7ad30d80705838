"""The sample order: which dataset index each global position of an epoch reads, and who reads it.

An epoch's global order is a pure function of (seed, epoch, dataset length), computed per
position (a keyed permutation), so no process holds an epoch-sized array; global position p
goes to rank p % world_size, and a rank's stream is dealt to its loader workers in blocks.
A count of consumed positions is thus the whole position of a run, under any world size
(state.py keeps it resumable).

The shard-aware order (`shuffle="shards"`, `shard_order_at`) keeps that dealing and changes only
which index a position reads: runs of `window` consecutive shards are laid out in a
per-epoch order and cut into `groups` canonical streams of equal length, stream c filling
positions c, c + groups, ...; a stream reads its stretch a window of `window` shards at a
time, in an order permuted within the window. When the world size divides `groups`, rank r reads only streams r, r + world_size,
..., so a machine reads about its share of the shards per epoch, not all of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays: every input bit reaches every output bit."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    base = _mix(np.asarray([(seed * 0x9E3779B97F4A7C15 + epoch) & _MASK64], dtype=np.uint64))
    return [
        _mix(base ^ np.uint64((r + 1) * 0xD1B54A32D192ED03 & _MASK64))[0] for r in range(_ROUNDS)
    ]


def _feistel(x: np.ndarray, half: Any, keys: list[Any]) -> np.ndarray:
    """A balanced Feistel network on 2 * `half`-bit integers: a bijection of [0, 4**half).
    `half` and each key: one for all values, or one per value (arrays like x)."""
    half = np.asarray(half, dtype=np.uint64)
    low = (np.uint64(1) << half) - np.uint64(1)
    left, right = x >> half, x & low
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & low)
    return (left << half) | right


def order_at(
    positions: np.ndarray,
    num_items: int,
    seed: int,
    epoch: int,
    shuffle: bool | str = True,
    layout: ShardLayout | None = None,
) -> np.ndarray:
    """Dataset indices at global positions of one epoch's order, computed per position: a
    pseudo-random permutation of [0, num_items) keyed by (seed, epoch) (a Feistel network,
    cycle-walked into range), so no process holds an epoch-sized array. A position past the
    end reads position % num_items (the padding of epoch_end). `shuffle="shards"`: the
    shard-aware order of `layout` (`shard_order_at`)."""
    positions = np.asarray(positions, dtype=np.int64) % max(num_items, 1)
    if shuffle == "shards":
        if layout is None:
            raise ValueError('shuffle="shards" needs the shards\' layout (ShardLayout)')
        return shard_order_at(positions, layout, seed, epoch)
    if not shuffle or num_items <= 1:
        return positions
    half = max(1, ((num_items - 1).bit_length() + 1) // 2)
    keys = _round_keys(seed, epoch)
    out = _feistel(positions.astype(np.uint64), half, keys)
    outside = np.flatnonzero(out >= np.uint64(num_items))
    while len(outside):  # cycle walking: the domain is at most 4 * num_items, so few rounds
        out[outside] = _feistel(out[outside], half, keys)
        outside = outside[out[outside] >= np.uint64(num_items)]
    return out.astype(np.int64)


def epoch_order(
    num_items: int,
    seed: int,
    epoch: int,
    shuffle: bool | str = True,
    layout: ShardLayout | None = None,
) -> np.ndarray:
    """Dataset indices of one epoch in global order (`order_at` of every position): for tests
    and tools; loaders compute the positions they read, a block at a time."""
    positions = np.arange(num_items, dtype=np.int64)
    return order_at(positions, num_items, seed, epoch, shuffle, layout)


def order_blocks(
    start: int,
    end: int,
    step: int,
    num_items: int,
    seed: int,
    epoch: int,
    shuffle: bool | str,
    block: int = 1024,
    layout: ShardLayout | None = None,
) -> Iterator[int]:
    """Dataset indices at positions range(start, end, step), computed `block` at a time."""
    for first in range(start, end, step * block):
        positions = np.arange(first, min(end, first + step * block), step, dtype=np.int64)
        yield from order_at(positions, num_items, seed, epoch, shuffle, layout).tolist()


def worker_of(q: Any, block: int, num_workers: int) -> Any:
    """Which loader worker reads the q-th index of a rank's stream (an int or an array): blocks
    of `block` indices dealt round robin (`dataflow.distributors.worker_share`)."""
    return (q // block) % num_workers


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


# --- the shard-aware order ---------------------------------------------------------------


class ShardLayout:
    """What the shard-aware order reads besides (seed, epoch): `bounds`, each shard's first
    item (S + 1 values, 0 to the item count: `shard_bounds`), the number of canonical
    `groups` (fixed at a run's start, kept in its state) and the `window` of shards a stream
    permutes within. The epoch lays out runs of `window` consecutive shards in a keyed
    order, not single shards: a `seq` window that ends past its shard reads the next shard
    (its label token), which is then most often in the same run, on the same machine.
    Keeps the last epoch's shard order (S values): a block of positions costs a search in
    it, not a new one."""

    def __init__(self, bounds: np.ndarray, groups: int, window: int) -> None:
        bounds = np.asarray(bounds, dtype=np.int64)
        if len(bounds) < 2 or bounds[0] != 0 or np.any(np.diff(bounds) < 0) or bounds[-1] < 1:
            raise ValueError(
                "shard bounds must start at 0, never decrease and end at the item count (>= 1)"
            )
        for name, value in (("canonical_groups", groups), ("shard_window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.bounds, self.groups, self.window = bounds, groups, window
        self.num_items = int(bounds[-1])
        shards = len(bounds) - 1
        self.window_items = max(1, round(window * self.num_items / shards))  # samples per window
        self._slots: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def slots(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(shard at each slot of the epoch's layout, each slot's first layout position)."""
        if self._slots is None or self._slots[:2] != (seed, epoch):
            shards = len(self.bounds) - 1
            blocks = -(-shards // self.window)  # runs of `window` consecutive shards
            first = order_at(np.arange(blocks), blocks, seed, epoch) * self.window
            order = (first[:, None] + np.arange(self.window)).ravel()
            order = order[order < shards]
            starts = np.concatenate([[0], np.cumsum(np.diff(self.bounds)[order])])
            self._slots = (seed, epoch, order, starts)
        return self._slots[2], self._slots[3]


def shard_order_at(positions: np.ndarray, layout: ShardLayout, seed: int, epoch: int) -> np.ndarray:
    """Dataset indices at global positions of the shard-aware order (see the module docstring).

    The epoch's shards, in an order keyed by (seed, epoch), are laid end to end; stretch c of
    the `groups` equal stretches of that layout (the first `n % groups` one item longer) is
    canonical stream c, read at positions c, c + groups, ...; its k-th item lies in window
    k // window_items of the stretch, at a place permuted within the window (keyed by the
    window). A bijection of [0, n), computed per position like `order_at`."""
    n, groups = layout.num_items, layout.groups
    p = np.asarray(positions, dtype=np.int64) % n
    per, longer = divmod(n, groups)
    full = per * groups  # positions of the rounds every stream takes part in
    stream = np.where(p < full, p % groups, p - full)
    k = np.where(p < full, p // groups, per)  # the item's place in its stream
    length = per + (stream < longer)
    start = stream * per + np.minimum(stream, longer)  # the stream's stretch of the layout
    size = layout.window_items
    first = k - k % size  # the item's window, as its first place in the stream
    span = np.minimum(size, length - first)
    window_start = start + first
    x = window_start + _permute_within(k - first, span, seed, epoch, window_start)
    order, slot_starts = layout.slots(seed, epoch)
    slot = np.searchsorted(slot_starts, x, side="right") - 1  # a slot of a non-empty shard
    return layout.bounds[order[slot]] + (x - slot_starts[slot])


def _permute_within(
    j: np.ndarray, span: np.ndarray, seed: int, epoch: int, ids: np.ndarray
) -> np.ndarray:
    """Place j of a window of `span` items (0 <= j < span), permuted by a Feistel network
    keyed by (seed, epoch, the window's id): each window its own permutation of [0, span)."""
    limit = span.astype(np.uint64) - np.uint64(1)
    bits = np.zeros(len(span), dtype=np.uint64)
    while np.any(limit >> bits):  # bits of span - 1, per window
        bits += (limit >> bits) > 0
    half = np.maximum(np.uint64(1), (bits + np.uint64(1)) // np.uint64(2))
    base = _round_keys(seed, epoch)[0]
    window = _mix(np.asarray(ids, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ base)
    keys = [
        _mix(window ^ np.uint64((r + 1) * 0xD1B54A32D192ED03 & _MASK64)) for r in range(_ROUNDS)
    ]
    out = _feistel(j.astype(np.uint64), half, keys)
    outside = np.flatnonzero(out >= span.astype(np.uint64))
    while len(outside):  # cycle walking, as in order_at
        out[outside] = _feistel(out[outside], half[outside], [key[outside] for key in keys])
        outside = outside[out[outside] >= span[outside].astype(np.uint64)]
    return out.astype(np.int64)


def shard_bounds(dataset: Any) -> np.ndarray:
    """Each shard's first item (S + 1 values, 0 to len(dataset)): item i lies in shard s when
    bounds[s] <= i < bounds[s + 1] (a window: the shard of its first token), as the
    dataset's own `shard_bounds()` tells; checked, and refused by name where it has none."""
    n = len(dataset)
    own = getattr(dataset, "shard_bounds", None)
    if not callable(own):
        raise ValueError(
            f'shuffle="shards" needs to know which shard each item is in: '
            f"{type(dataset).__name__} has no shard_bounds() (datasets of DatasetFactory have)"
        )
    bounds = np.asarray(own(), dtype=np.int64)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or np.any(np.diff(bounds) < 0):
        raise ValueError(
            f"{type(dataset).__name__}.shard_bounds() must run from 0 to its {n} items, never "
            f"decreasing; got {bounds[:3].tolist()}...{bounds[-2:].tolist()}"
        )
    return bounds
