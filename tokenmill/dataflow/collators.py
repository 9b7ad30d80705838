"""BatchCollator: the fourth and last dataflow role, one group of samples -> one batch.

DataDistributor -> RawItemProcessor -> SampleBatcher -> BatchCollator. A collator
is also a callable, so any of them works as `collate_fn` of a plain torch DataLoader.
Padding conventions: ids take `pad_id`, `target_ids` take `label_pad_id` (-100,
PyTorch's cross-entropy `ignore_index`), masks take False, positions take 0.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from tokenmill.dataflow.contracts import keeps
from tokenmill.shards.schema import schema_of
from tokenmill.training.windows import WindowBatch

__all__ = [
    "BatchCollator",
    "DefaultBatchCollator",
    "SFTPaddingCollator",
    "DPOPaddingCollator",
    "KTOPaddingCollator",
    "GRPOPaddingCollator",
    "PackedCollator",
    "PADDING_COLLATORS",
    "fitting_argument",
]


class BatchCollator(ABC):
    """Collates one group of samples into one batch dict for ``model.forward()``."""

    @abstractmethod
    def collate(self, samples: list[dict]) -> dict: ...

    def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
        """Hook: the batch `collate` makes of a group of stored windows (a WindowBatch's arrays,
        each key [B, W + 1] as stored), which the loader collates on the training side. This
        default collates the windows' items; a collator that makes the same batch without
        items overrides it (DefaultBatchCollator, PackedCollator, while their `collate` is
        their own)."""
        return self.collate(WindowBatch(arrays).items())

    def __call__(self, samples: list[dict]) -> dict:
        return self.collate(samples)


def pad_stack(
    tensors: Sequence[torch.Tensor],
    value: float | bool,
    left: bool = False,
    length: int | None = None,
) -> torch.Tensor:
    """Stack 1-D tensors into [N, L], L = `length` or the longest, filling with `value`."""
    length = max((len(t) for t in tensors), default=0) if length is None else length
    dtype = tensors[0].dtype if tensors else torch.long
    out = torch.full((len(tensors), length), value, dtype=dtype)
    for row, t in enumerate(tensors):
        if left:
            out[row, length - len(t) :] = t
        else:
            out[row, : len(t)] = t
    return out


def attention_mask(lengths: Sequence[int], length: int, left: bool = False) -> torch.Tensor:
    """[N, L] bool, True on the real tokens of each row."""
    positions = torch.arange(length)
    real = torch.as_tensor(list(lengths), dtype=torch.long).unsqueeze(1)
    return positions >= length - real if left else positions < real


def require_keys(samples: list[dict], keys: Sequence[str], collator: str) -> None:
    """A non-empty group whose every sample holds `keys`, refused by name otherwise."""
    if not samples:
        raise ValueError(f"{collator}: cannot collate an empty group")
    for i, sample in enumerate(samples):
        missing = [k for k in keys if k not in sample]
        if missing:
            raise KeyError(f"{collator}: sample {i} lacks {missing}; it has {sorted(sample)}")


class DefaultBatchCollator(BatchCollator):
    """Stacks each key: tensors to [B, ...], lists of equal-shape tensors to [B, G, ...],
    numbers to [B]. Unequal lengths raise, naming the padding collator the items take."""

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, list(samples[0]) if samples else [], "DefaultBatchCollator")
        try:
            return {key: self._stack(key, [s[key] for s in samples]) for key in samples[0]}
        except _Unequal as err:  # named with the collator these items take
            raise ValueError(f"{err}: {fitting_argument(samples[0])}") from None

    def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
        """The windows stacked as stored, cut and widened (`WindowBatch.tensors`), while
        `collate` (and the `_stack` it calls) is this class's."""
        if not keeps(self, DefaultBatchCollator, "collate", "_stack"):
            return super().collate_windows(arrays)
        return WindowBatch(arrays).tensors()

    def _stack(self, key: str, values: list[Any]) -> torch.Tensor:
        if isinstance(values[0], (list, tuple)):  # a GRPO group's responses: equal ones only
            inner = {tuple(torch.as_tensor(v).shape) for group in values for v in group}
            if len(inner) > 1:
                raise _Unequal(
                    f"DefaultBatchCollator: key {key!r} holds shapes {sorted(inner)} in one "
                    "group; stacking needs equal shapes"
                )
            values = [torch.stack([torch.as_tensor(v) for v in group]) for group in values]
        elif not isinstance(values[0], torch.Tensor):
            return torch.as_tensor(values)
        shapes = {tuple(v.shape) for v in values}
        if len(shapes) > 1:
            raise _Unequal(
                f"DefaultBatchCollator: key {key!r} has shapes {sorted(shapes)} in one group; "
                "stacking needs equal shapes"
            )
        return torch.stack(values)


class _Unequal(ValueError):
    """Samples of unequal shapes: DefaultBatchCollator names the collator they take."""


class SFTPaddingCollator(BatchCollator):
    """Right-pads seq/sft items to the longest in the group: input_ids with `pad_id`,
    target_ids with `label_pad_id`, loss_mask with False, position_ids with 0; adds
    `attention_mask` (bool, True on real tokens). `mask_targets=True` also writes
    `label_pad_id` into targets whose loss_mask is False, for losses that read only ids.

    A row that packs several conversations keeps them apart only through its position_ids:
    a Hugging Face model given this attention_mask attends across them, so for such rows call
    it with position_ids, no attention_mask and use_cache=False (docs/training.md)."""

    def __init__(self, pad_id: int = 0, label_pad_id: int = -100, mask_targets: bool = False):
        self.pad_id = pad_id
        self.label_pad_id = label_pad_id
        self.mask_targets = mask_targets

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["input_ids", "target_ids"], "SFTPaddingCollator")
        lengths = [len(s["input_ids"]) for s in samples]
        length = max(lengths)
        batch = {
            "input_ids": pad_stack([s["input_ids"] for s in samples], self.pad_id),
            "target_ids": pad_stack([s["target_ids"] for s in samples], self.label_pad_id),
            "attention_mask": attention_mask(lengths, length),
        }
        if "loss_mask" in samples[0]:
            batch["loss_mask"] = pad_stack([s["loss_mask"] for s in samples], False)
            if self.mask_targets:
                batch["target_ids"][~batch["loss_mask"]] = self.label_pad_id
        if "position_ids" in samples[0]:
            batch["position_ids"] = pad_stack([s["position_ids"] for s in samples], 0)
        return batch


class DPOPaddingCollator(BatchCollator):
    """Right-pads chosen and rejected to one common length (the longest of both across the
    group), so a model can run them as one [2B, L] batch; masks pad with False and each side
    gets its `<side>_attention_mask`."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def collate(self, samples: list[dict]) -> dict:
        sides = ("chosen", "rejected")
        require_keys(samples, [*sides, "chosen_mask", "rejected_mask"], "DPOPaddingCollator")
        length = max(len(s[side]) for s in samples for side in sides)
        batch = {}
        for side in sides:
            batch[side] = pad_stack([s[side] for s in samples], self.pad_id, length=length)
            batch[f"{side}_mask"] = pad_stack(
                [s[f"{side}_mask"] for s in samples], False, length=length
            )
            lengths = [len(s[side]) for s in samples]
            batch[f"{side}_attention_mask"] = attention_mask(lengths, length)
        return batch


class KTOPaddingCollator(BatchCollator):
    """Right-pads KTO items (TRL's unpaired preference data) to the longest in the group:
    `completion` with `pad_id`, `completion_mask` with False, plus `attention_mask` (True on
    real tokens) and `label` [B] (1.0 desirable, 0.0 not), the name TRL's KTO collator gives
    it."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["completion", "completion_mask", "label"], "KTOPaddingCollator")
        lengths = [len(s["completion"]) for s in samples]
        length = max(lengths)
        labels = [torch.as_tensor(s["label"], dtype=torch.float32).reshape(()) for s in samples]
        return {
            "completion": pad_stack([s["completion"] for s in samples], self.pad_id),
            "completion_mask": pad_stack([s["completion_mask"] for s in samples], False),
            "attention_mask": attention_mask(lengths, length),
            "label": torch.stack(labels),
        }


class GRPOPaddingCollator(BatchCollator):
    """Prompts left-padded to [B, P] (generation continues from the right edge) with
    `prompt_attention_mask`; responses and masks right-padded to [B, G, R] with
    `response_attention_mask`; rewards [B, G]. Groups of unequal size are padded with empty
    responses and reward 0, and `group_mask` [B, G] is True on the real ones. Prompt-only
    items (prompts for online generation) give the prompts and their mask alone."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["prompts"], "GRPOPaddingCollator")
        prompt_lengths = [len(s["prompts"]) for s in samples]
        prompts = {
            "prompts": pad_stack([s["prompts"] for s in samples], self.pad_id, left=True),
            "prompt_attention_mask": attention_mask(prompt_lengths, max(prompt_lengths), left=True),
        }
        if all(set(s) == {"prompts"} for s in samples):  # nothing generated yet
            return prompts
        require_keys(samples, ["prompts", "responses", "masks", "rewards"], "GRPOPaddingCollator")
        groups = max(len(s["responses"]) for s in samples)
        resp_len = max((len(r) for s in samples for r in s["responses"]), default=0)
        shape = (len(samples), groups, resp_len)
        responses = torch.full(shape, self.pad_id, dtype=torch.long)
        masks = torch.zeros(shape, dtype=torch.bool)
        resp_attention = torch.zeros(shape, dtype=torch.bool)
        rewards = torch.zeros((len(samples), groups), dtype=torch.float32)
        group_mask = torch.zeros((len(samples), groups), dtype=torch.bool)
        for b, s in enumerate(samples):
            size = len(s["responses"])
            for g, (resp, mask) in enumerate(zip(s["responses"], s["masks"], strict=True)):
                responses[b, g, : len(resp)] = resp
                masks[b, g, : len(mask)] = mask
                resp_attention[b, g, : len(resp)] = True
            rewards[b, :size] = torch.as_tensor(s["rewards"], dtype=torch.float32)
            group_mask[b, :size] = True
        return {
            **prompts,
            "responses": responses,
            "masks": masks,
            "response_attention_mask": resp_attention,
            "rewards": rewards,
            "group_mask": group_mask,
        }


class PackedCollator(BatchCollator):
    """Concatenates a group's seq/sft samples into one row [1, T] for variable-length
    attention: `cu_seqlens` (int32, document starts plus T) and `max_seqlen` as flash-attn
    varlen kernels take them, `position_ids` restarting at 0 for every document, and
    `num_tokens` (real tokens). A document ends at each sample's end and inside a sample where
    its stored boundaries say (`doc_lengths`, which row and record samples carry). A sample
    without them (a stream window) is split wherever its `position_ids` do not go on by one
    (a restart at 0, or the remainder of a document that bfd_split cut); in shards the
    pipeline writes, positions that go on by one always stay in one document (see
    `plan_packing`). `pad_to=N` pads the row to N tokens as one extra segment, for static
    shapes; efficiency is `num_tokens / N`. A Hugging Face model called with `input_ids` and
    `position_ids`, no attention mask and no cache (`use_cache=False`, as TRL's trainers call
    it) attends only inside each document: transformers makes its causal mask block-diagonal
    where positions do not go on by one (`masking_utils.find_packed_sequence_indices`)."""

    def __init__(self, pad_id: int = 0, label_pad_id: int = -100, pad_to: int | None = None):
        if pad_to is not None and pad_to <= 0:
            raise ValueError(f"pad_to must be positive, got {pad_to}")
        self.pad_id = pad_id
        self.label_pad_id = label_pad_id
        self.pad_to = pad_to

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["input_ids", "target_ids"], "PackedCollator")
        starts: list[int] = []
        offset = 0
        for s in samples:
            starts.append(offset)
            if "doc_lengths" in s:  # stored boundaries: nothing to infer
                lengths = torch.as_tensor(s["doc_lengths"])
                if int(lengths.sum()) != len(s["input_ids"]):
                    raise ValueError(
                        f"PackedCollator: doc_lengths sum to {int(lengths.sum())}, the sample has "
                        f"{len(s['input_ids'])} input_ids; cut them together (TruncateProcessor does)"
                    )
                inner = torch.cumsum(lengths, 0)[:-1]
                starts.extend((inner + offset).tolist())
            elif "position_ids" in s and len(s["position_ids"]):
                # a document starts wherever positions do not go on by one: a restart at 0, or
                # a bfd_split remainder (s, s+1, ...) that follows another document's end
                positions = s["position_ids"]
                breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
                starts.extend((breaks + offset).tolist())
            offset += len(s["input_ids"])
        keys = ["input_ids", "target_ids", *(["loss_mask"] if "loss_mask" in samples[0] else [])]
        flat = {key: torch.cat([s[key] for s in samples]) for key in keys}
        return self._packed(starts, offset, flat)

    def collate_stacked(self, stacked: dict[str, torch.Tensor]) -> dict:
        """What `collate` makes of the rows of [B, W] samples of one length (windows, as the
        loader hands them over), without a Python step per sample."""
        rows, width = stacked["input_ids"].shape
        positions = stacked["position_ids"].numpy() if "position_ids" in stacked else None
        keys: list[str] = [k for k in ("input_ids", "target_ids", "loss_mask") if k in stacked]
        flat = {k: stacked[k].reshape(-1).clone() for k in keys}  # never the caller's storage
        return self._packed(window_starts(rows, width, positions), rows * width, flat)

    def collate_windows(self, arrays: dict[str, torch.Tensor]) -> dict:
        """What `collate` makes of the items of stored windows (a WindowBatch's arrays: each
        key [B, W + 1] as stored): each key cut and widened in one copy, straight into the
        packed row, on the training side of a loader; while `collate` (and the `_packed` and
        `_pad` it calls) is this class's: a subclass that overrides one gets its `collate` of
        the items."""
        if not keeps(self, PackedCollator, "collate", "_packed", "_pad"):
            return super().collate_windows(arrays)
        sequence = arrays["sequence"].numpy()
        rows, width = sequence.shape[0], sequence.shape[1] - 1
        wide = {
            "input_ids": _widened(sequence[:, :-1], np.int64),
            "target_ids": _widened(sequence[:, 1:], np.int64),
        }
        if "loss_mask" in arrays:
            wide["loss_mask"] = _widened(arrays["loss_mask"].numpy()[:, 1:], np.bool_)
        if "position_ids" not in arrays and self.pad_to is None:
            # a document per window: the bounds a step of W, the positions one tiling, built
            # without the general way's steps (half this collate's time, on the training side)
            tiling = _tiling(width, rows).reshape(1, -1).copy()
            batch: dict[str, Any] = {
                "input_ids": torch.from_numpy(wide["input_ids"]),
                "target_ids": torch.from_numpy(wide["target_ids"]),
                "position_ids": torch.from_numpy(tiling),
                "cu_seqlens": torch.from_numpy(np.arange(rows + 1, dtype=np.int32) * width),
                "max_seqlen": width,
                "num_tokens": rows * width,
            }
            if "loss_mask" in wide:  # last, as `collate` puts it
                batch["loss_mask"] = torch.from_numpy(wide["loss_mask"])
            return batch
        positions = arrays["position_ids"].numpy()[:, :-1] if "position_ids" in arrays else None
        flat = {k: torch.from_numpy(v[0]) for k, v in wide.items()}
        return self._packed(window_starts(rows, width, positions), rows * width, flat)

    def _packed(
        self, starts: Sequence[int] | np.ndarray, num_tokens: int, flat: dict[str, torch.Tensor]
    ) -> dict:
        """The batch from document starts and the samples' keys concatenated (fresh tensors,
        the batch's own), padded to pad_to."""
        if self.pad_to is not None and num_tokens > self.pad_to:
            raise ValueError(
                f"PackedCollator: group has {num_tokens} tokens, over pad_to={self.pad_to}; "
                "batch with a token budget no larger than pad_to"
            )
        total = num_tokens if self.pad_to is None else self.pad_to
        ends = [num_tokens, total] if total > num_tokens else [total]
        bounds = np.empty(len(starts) + len(ends), dtype=np.int64)
        bounds[: len(starts)], bounds[len(starts) :] = starts, ends
        sizes = bounds[1:] - bounds[:-1]
        pad = total - num_tokens
        batch = {
            "input_ids": self._pad(flat["input_ids"], self.pad_id, pad),
            "target_ids": self._pad(flat["target_ids"], self.label_pad_id, pad),
            "position_ids": torch.from_numpy(segment_positions(bounds, sizes)).unsqueeze(0),
            "cu_seqlens": torch.from_numpy(bounds.astype(np.int32)),
            "max_seqlen": int(sizes.max()) if len(sizes) else 0,
            "num_tokens": num_tokens,
        }
        if "loss_mask" in flat:
            batch["loss_mask"] = self._pad(flat["loss_mask"], False, pad)
        return batch

    @staticmethod
    def _pad(values: torch.Tensor, value: Any, pad: int) -> torch.Tensor:
        """[1, len + pad]: `values` (the batch's own) and `pad` times `value`."""
        if not pad:
            return values.unsqueeze(0)
        return torch.cat([values, torch.full((pad,), value, dtype=values.dtype)]).unsqueeze(0)


PADDING_COLLATORS: dict[str, type[BatchCollator]] = {
    "seq": SFTPaddingCollator,
    "sft": SFTPaddingCollator,
    "dpo": DPOPaddingCollator,
    "kto": KTOPaddingCollator,
    "grpo": GRPOPaddingCollator,
}
"""The padding collator of each training type's items (`tokenmill.shards.schema.ITEMS`)."""


def fitting_argument(sample: dict) -> str:
    """What to give a loader for items like `sample` that do not stack: the one argument."""
    try:
        train_type = schema_of(sample).train_type
    except KeyError:
        return "give the loader a collator that pads or packs these items"
    name = PADDING_COLLATORS[train_type].__name__
    return f"pass collator={name}() to the loader (or a packing batcher and a packed collator)"


def window_starts(rows: int, width: int, positions: np.ndarray | None) -> np.ndarray:
    """Document starts in B rows of W tokens packed in a row: each row's start, and where
    the rows' positions [B, W] (if any) do not go on by one."""
    starts = np.arange(rows, dtype=np.int64) * width
    if positions is not None and width:
        row, col = np.nonzero(positions[:, 1:] != positions[:, :-1] + np.int64(1))
        starts = np.sort(np.concatenate([starts, row * width + col + 1]))
    return starts


def segment_positions(bounds: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each token's position in its segment [bounds[k], bounds[k + 1]): 0, 1, ... (int64).
    Segments of one size (windows) copy one remembered tiling, a fifth of the general way.
    numpy, not torch: torch's intra-op threads make these small ops slow on a busy core."""
    if len(sizes) and (sizes == sizes[0]).all():
        return _tiling(int(sizes[0]), len(sizes)).copy()
    return np.arange(bounds[-1], dtype=np.int64) - np.repeat(bounds[:-1], sizes)


def _widened(values: np.ndarray, dtype: type) -> np.ndarray:
    """[B, W] `values` as one new [1, B * W] array of `dtype`: one copy."""
    out: np.ndarray = np.empty((1, values.size), dtype)
    out.reshape(values.shape)[...] = values
    return out


@lru_cache(maxsize=8)
def _tiling(size: int, count: int) -> np.ndarray:
    tiles = np.tile(np.arange(size, dtype=np.int64), count)
    tiles.flags.writeable = False  # shared by every batch of this shape: each gets a copy
    return tiles
