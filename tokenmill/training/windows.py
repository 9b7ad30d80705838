"""What crosses a loader's worker pipe: WindowBatch (a batch of fixed-length samples as stored),
or a collated batch, each as bytes in the pipe up to PIPE_BYTES."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# A batch up to this size crosses a worker pipe as bytes in the pipe; a larger one in shared
# memory, torch's way for tensors: a segment, a file descriptor and a map per tensor, on both
# sides (measured: about twice the CPU of the bytes for a 64 KB batch, even at 2 MB).
PIPE_BYTES = 2 << 20


@dataclass
class WindowBatch:
    """A batch of fixed-length samples as stored: each key [B, W + 1] in its stored dtype
    (int32 tokens), the one token more being the last target. This is what crosses a worker
    pipe: a quarter of the bytes of int64 inputs and targets. `tensors()` makes the batch a
    trainer takes, on the training side: what DefaultBatchCollator makes of the items."""

    arrays: dict[str, torch.Tensor]

    def __reduce__(self) -> tuple[Any, tuple]:
        """Pickled (as a DataLoader worker hands it over): numpy arrays, which pickle by value,
        up to PIPE_BYTES; torch tensors, which DataLoader shares in memory, above or where
        numpy cannot hold one (a store of bfloat16)."""
        arrays = _by_value(self.arrays)
        if arrays is None:
            return WindowBatch, (self.arrays,)
        return _from_numpy, (arrays,)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The items stacked: [B, W] each."""
        return self._shifted(self.arrays)

    def items(self) -> list[dict[str, torch.Tensor]]:
        """The items, as the dataset's `__getitem__` gives them, for any other collator."""
        wide = self._shifted(self.arrays)
        return [{k: v[j] for k, v in wide.items()} for j in range(len(self.arrays["sequence"]))]

    @staticmethod
    def _shifted(arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inputs, targets and masks cut along the last axis and widened: one contiguous copy
        each, so `.view(-1)` works as on stacked items."""

        def cut(key: str, part: slice, dtype: torch.dtype) -> torch.Tensor:
            return arrays[key][..., part].to(dtype).contiguous()

        out = {
            "input_ids": cut("sequence", slice(None, -1), torch.int64),
            "target_ids": cut("sequence", slice(1, None), torch.int64),
        }
        if "loss_mask" in arrays:
            out["loss_mask"] = cut("loss_mask", slice(1, None), torch.bool)
        if "position_ids" in arrays:
            out["position_ids"] = cut("position_ids", slice(None, -1), torch.int64)
        return out


def _by_value(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """The tensors as numpy arrays, to pickle by value: None above PIPE_BYTES in all, or where
    numpy cannot hold one (bfloat16, a tensor that needs grad)."""
    if sum(v.nbytes for v in tensors.values()) > PIPE_BYTES:
        return None
    try:
        return {k: v.numpy() for k, v in tensors.items()}
    except (TypeError, RuntimeError):
        return None


def _from_numpy(arrays: dict[str, np.ndarray]) -> WindowBatch:
    return WindowBatch(_as_tensors(arrays, arrays))


class PipedBatch:
    """A worker's collated batch (a dict) on its way across the pipe: its tensors as numpy
    arrays, pickled by value, up to PIPE_BYTES; unpickled, a plain dict again, each tensor
    its own contiguous copy (views and shared storages are not kept). Above that, or with a
    tensor numpy cannot hold (bfloat16), the tensors cross in shared memory."""

    def __init__(self, batch: dict) -> None:
        self.batch = batch

    def __reduce__(self) -> tuple[Any, tuple]:
        arrays = _by_value({k: v for k, v in self.batch.items() if isinstance(v, torch.Tensor)})
        if arrays is None:
            return dict, (self.batch,)
        return _as_tensors, ({**self.batch, **arrays}, list(arrays))


def piped(outputs: Iterator[tuple[Any, dict, dict]]) -> Iterator[tuple[Any, dict, dict]]:
    """A worker's (batch, position, counters), each collated batch as a PipedBatch."""
    for batch, position, counters in outputs:
        yield (PipedBatch(batch) if type(batch) is dict else batch), position, counters


def _as_tensors(batch: dict, keys: Collection[str]) -> dict:
    return {k: torch.from_numpy(v) if k in keys else v for k, v in batch.items()}
