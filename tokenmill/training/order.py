"""The sample order: which dataset index each global position of an epoch reads, and who reads it.

An epoch's global order is a pure function of (seed, epoch, dataset length), computed per
position (a keyed permutation), so no process holds an epoch-sized array; global position p
goes to rank p % world_size, and a rank's stream is dealt to its loader workers in blocks.
A count of consumed positions is thus the whole position of a run, under any world size
(state.py keeps it resumable).
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


def _feistel(x: np.ndarray, half: int, keys: list[np.uint64]) -> np.ndarray:
    """A balanced Feistel network on 2 * `half`-bit integers: a bijection of [0, 4**half)."""
    low = np.uint64((1 << half) - 1)
    left, right = x >> np.uint64(half), x & low
    for key in keys:
        left, right = right, left ^ (_mix(right ^ key) & low)
    return (left << np.uint64(half)) | right


def order_at(
    positions: np.ndarray, num_items: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """Dataset indices at global positions of one epoch's order, computed per position: a
    pseudo-random permutation of [0, num_items) keyed by (seed, epoch) (a Feistel network,
    cycle-walked into range), so no process holds an epoch-sized array. A position past the
    end reads position % num_items (the padding of epoch_end)."""
    positions = np.asarray(positions, dtype=np.int64) % max(num_items, 1)
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


def epoch_order(num_items: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Dataset indices of one epoch in global order (`order_at` of every position): for tests
    and tools; loaders compute the positions they read, a block at a time."""
    return order_at(np.arange(num_items, dtype=np.int64), num_items, seed, epoch, shuffle)


def order_blocks(
    start: int,
    end: int,
    step: int,
    num_items: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    block: int = 1024,
) -> Iterator[int]:
    """Dataset indices at positions range(start, end, step), computed `block` at a time."""
    for first in range(start, end, step * block):
        positions = np.arange(first, min(end, first + step * block), step, dtype=np.int64)
        yield from order_at(positions, num_items, seed, epoch, shuffle).tolist()


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
