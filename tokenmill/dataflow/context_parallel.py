"""Context parallelism: one packed batch [1, T] split across the `cp_size` ranks of a
context-parallel group, each sequence load-balanced for causal attention.

The layout is Megatron's and TransformerEngine's THD layout (`thd_get_partitioned_indices`):
each sequence of `cu_seqlens` is padded at its end to a multiple of 2 * cp_size and cut into
2 * cp_size equal chunks; rank r keeps chunks r and 2 * cp_size - 1 - r, an early chunk and a
late one, so that every rank does the same causal-attention work. Every rank holds a part of
every sequence, so per-sequence keys (`chosen_index`, `group_ids`, `rewards`) hold on every
rank as they are.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tokenmill.dataflow.collators import BatchCollator, PackedCollator
from tokenmill.dataflow.contracts import keeps

__all__ = ["ContextParallelCollator", "context_parallel_slice", "context_parallel_gather"]

# Keys the slice computes; every other [1, T] tensor is per token and is split.
_SLICE_KEYS = ("cu_seqlens", "max_seqlen", "num_tokens", "global_cu_seqlens")
_GLOBAL_KEYS = ("global_cu_seqlens", "global_cu_seqlens_padded")


def _layout(cu_seqlens: torch.Tensor, cp_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the sequences' bounds, each padded to a multiple of 2 * cp_size; each sequence's real
    length), int64. One rank pads nothing: it has no chunks to balance."""
    bounds = cu_seqlens.numpy().astype(np.int64)
    lengths = np.diff(bounds)
    step = 2 * cp_size if cp_size > 1 else 1
    padded = np.zeros(len(bounds), dtype=np.int64)
    np.cumsum(-(-lengths // step) * step, out=padded[1:])
    return padded, lengths


def _rank_tokens(
    bounds: np.ndarray, padded: np.ndarray, lengths: np.ndarray, cp_size: int, cp_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each token of rank `cp_rank`'s slice, in order: its offset in its padded sequence,
    whether it is a token of the batch (not CP padding), and its index in the batch."""
    if cp_size == 1:  # the batch as it is
        index = np.arange(bounds[-1], dtype=np.int64)
        return index - np.repeat(bounds[:-1], lengths), np.ones(len(index), bool), index
    chunk = np.diff(padded) // (2 * cp_size)
    local = padded // cp_size  # the rank's bounds: 2 chunks of each sequence
    k = np.arange(local[-1], dtype=np.int64) - np.repeat(local[:-1], 2 * chunk)
    size = np.repeat(chunk, 2 * chunk)
    # chunk r, then chunk 2 * cp_size - 1 - r (whose k starts at `size`, hence the - 2)
    offset = np.where(k < size, cp_rank * size + k, (2 * cp_size - 2 - cp_rank) * size + k)
    real = offset < np.repeat(lengths, 2 * chunk)
    return offset, real, np.repeat(bounds[:-1], 2 * chunk) + offset


def _check_rank(cp_size: int, cp_rank: int, who: str) -> None:
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"{who}: cp_size must be a positive int, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"{who}: cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")


def _check(batch: dict, who: str) -> int:
    """The batch's token count T, after checking it is one packed row with its bounds."""
    for key in ("input_ids", "cu_seqlens"):
        if key not in batch:
            raise KeyError(f"{who}: the batch lacks {key!r} (a packed batch: PackedCollator's)")
    ids = batch["input_ids"]
    bounds = batch["cu_seqlens"]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"{who}: input_ids must be one packed row [1, T], got {list(ids.shape)}")
    if bounds.dim() != 1 or len(bounds) < 1 or int(bounds[0]) != 0:
        raise ValueError(f"{who}: cu_seqlens must be 1-D and start at 0, got {bounds.tolist()}")
    if int(bounds[-1]) != ids.shape[1] or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(
            f"{who}: cu_seqlens {bounds.tolist()} must rise to the row's {ids.shape[1]} tokens"
        )
    return int(ids.shape[1])


def _token_keys(batch: dict, tokens: int) -> list[str]:
    return [
        key
        for key, value in batch.items()
        if key not in _SLICE_KEYS
        and isinstance(value, torch.Tensor)
        and value.dim() == 2
        and tuple(value.shape) == (1, tokens)
    ]


def context_parallel_slice(
    batch: dict, cp_size: int, cp_rank: int, pad_id: int = 0, label_pad_id: int = -100
) -> dict:
    """Rank `cp_rank`'s part of a packed batch (PackedCollator's, or a packed preference
    collator's), 2 * ceil(L / (2 * cp_size)) tokens of each sequence of length L (with one
    rank, the batch as it is, and its bounds named as with several): every
    per-token key [1, T / cp_size padded]; `cu_seqlens` and `max_seqlen` of that slice (each
    sequence's two chunks, one after the other); `position_ids` each token's own, CP padding
    going on from its sequence's last; `num_tokens` the rank's tokens of the batch (they sum
    to the batch's); `global_cu_seqlens` and `global_cu_seqlens_padded`, the whole batch's
    bounds without and with the padding (TransformerEngine's `cu_seqlens_q` and
    `cu_seqlens_q_padded`); other keys as they are. CP padding takes `pad_id`,
    `label_pad_id`, loss_mask False, and 0 in other per-token keys."""
    who = "context_parallel_slice"
    _check_rank(cp_size, cp_rank, who)
    tokens = _check(batch, who)
    bounds = batch["cu_seqlens"].numpy().astype(np.int64)
    padded, lengths = _layout(batch["cu_seqlens"], cp_size)
    offset, real, source = _rank_tokens(bounds, padded, lengths, cp_size, cp_rank)
    where, taken = torch.from_numpy(real), torch.from_numpy(source[real])
    fill = {"input_ids": pad_id, "target_ids": label_pad_id}
    per_token = _token_keys(batch, tokens)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in per_token:
            if key == "position_ids":  # CP padding goes on counting its sequence's positions
                part = torch.tensor(offset, dtype=value.dtype)
            else:
                part = torch.full((len(offset),), fill.get(key, 0), dtype=value.dtype)
            part[where] = value[0, taken]
            out[key] = part.unsqueeze(0)
        elif key not in _SLICE_KEYS:
            out[key] = value
    local = padded // cp_size
    num_tokens = int(batch.get("num_tokens", tokens))
    out["cu_seqlens"] = torch.from_numpy(local.astype(np.int32))
    out["max_seqlen"] = int(np.diff(local).max()) if len(local) > 1 else 0
    out["num_tokens"] = int((source[real] < num_tokens).sum())
    out["global_cu_seqlens"] = batch["cu_seqlens"]
    out["global_cu_seqlens_padded"] = torch.from_numpy(padded.astype(np.int32))
    return out


def context_parallel_gather(slices: list[dict]) -> dict:
    """The batch that `context_parallel_slice` cut into `slices` (every rank's, in rank
    order), exactly: each per-token key put back in the batch's order, CP padding dropped."""
    who = "context_parallel_gather"
    if not slices:
        raise ValueError(f"{who}: no slices to gather")
    first = slices[0]
    for key in _GLOBAL_KEYS:
        for rank, part in enumerate(slices):
            if key not in part:
                raise KeyError(f"{who}: slice {rank} lacks {key!r} (not a context_parallel_slice)")
            if not torch.equal(part[key], first[key]):
                raise ValueError(f"{who}: slice {rank}'s {key} differs from slice 0's")
    cp_size = len(slices)
    global_bounds = first["global_cu_seqlens"]
    bounds = global_bounds.numpy().astype(np.int64)
    padded, lengths = _layout(global_bounds, cp_size)
    if not np.array_equal(padded, first["global_cu_seqlens_padded"].numpy()):
        raise ValueError(f"{who}: the slices were cut for another cp_size than {cp_size}")
    tokens = int(bounds[-1])
    local_tokens = int(padded[-1]) // cp_size
    keys = _token_keys(first, local_tokens)
    out: dict[str, Any] = {}
    for key in keys:
        out[key] = torch.empty((1, tokens), dtype=first[key].dtype)
    for rank, part in enumerate(slices):
        _, real, source = _rank_tokens(bounds, padded, lengths, cp_size, rank)
        where, taken = torch.from_numpy(real), torch.from_numpy(source[real])
        for key in keys:
            out[key][0, taken] = part[key][0, where]
    for key, value in first.items():
        if key not in keys and key not in _SLICE_KEYS and key not in _GLOBAL_KEYS:
            out[key] = value
    out["cu_seqlens"] = global_bounds
    out["max_seqlen"] = int(lengths.max()) if len(lengths) else 0
    out["num_tokens"] = sum(int(part["num_tokens"]) for part in slices)
    return out


class ContextParallelCollator(BatchCollator):
    """A group packed in one row by `packed` (default PackedCollator(pad_id, label_pad_id)),
    then rank `cp_rank`'s slice of it (`context_parallel_slice`). The `cp_size` ranks of a
    context-parallel group must collate the same groups: give their loader the data-parallel
    rank and world size (`dp_rank=`, `dp_world_size=`), not the global ones."""

    def __init__(
        self,
        cp_size: int,
        cp_rank: int,
        pad_id: int = 0,
        label_pad_id: int = -100,
        packed: BatchCollator | None = None,
    ):
        _check_rank(cp_size, cp_rank, "ContextParallelCollator")
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.pad_id = pad_id
        self.label_pad_id = label_pad_id
        self.packed = PackedCollator(pad_id, label_pad_id) if packed is None else packed

    def collate(self, samples: list[dict]) -> dict:
        return self._slice(self.packed.collate(samples))

    def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
        """The packed collator's batch of the windows (its own fast way), sliced; while
        `collate` (and the `_slice` it calls) is this class's."""
        if not keeps(self, ContextParallelCollator, "collate", "_slice"):
            return super().collate_windows(arrays)
        return self._slice(self.packed.collate_windows(arrays))

    def _slice(self, batch: dict) -> dict:
        return context_parallel_slice(
            batch, self.cp_size, self.cp_rank, self.pad_id, self.label_pad_id
        )
