"""Items in the names Hugging Face trainers take, and batches of them that keep documents apart.

tokenmill's items are already shifted (`input_ids` -> `target_ids`, `loss_mask` on targets);
Hugging Face causal LMs shift `labels` themselves. An HF item holds a sample's W + 1 tokens as
`input_ids`, the same ids as `labels`, -100 (cross-entropy's ignore index) where tokenmill
takes no loss, and `position_ids` that restart at 0 at each of its documents: an SFT row packs
several conversations, and none may see another.

transformers (5.x) keeps them apart by position alone: its causal mask is block-diagonal where
position ids do not go on by one, but only for a call with no attention mask and no cache
(`masking_utils.find_packed_sequence_indices`), and flash-attention kernels read documents off
position ids only in a batch of one row. So `HFCollator` makes no attention mask, puts
`use_cache=False` in every batch, and by default lays a batch out as one row. A document's
first token is never a label: fed alone it is the first token, which nothing predicts; packed,
it would be predicted from the document before it (TRL's padding-free collator drops it too).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenmill.shards.format import opens_document

IGNORE_INDEX = -100

HF_LAYOUT = "hf-documents"
"""Part of the Arrow cache's name: files written before labels and positions followed the
documents are never read back as these."""


def document_lengths(item: Mapping[str, Any]) -> torch.Tensor:
    """The lengths of an seq/sft item's documents in its W + 1 tokens (the last document holds
    the last target too): its stored `doc_lengths`, else a new document wherever its
    `position_ids` do not go on by one (`opens_document`), else one document. The same split
    as PackedCollator's."""
    inputs = len(item["input_ids"])
    if "doc_lengths" in item:
        lengths = torch.as_tensor(item["doc_lengths"], dtype=torch.int64).clone()
        if int(lengths.sum()) != inputs:
            raise ValueError(
                f"doc_lengths sum to {int(lengths.sum())}, the item has {inputs} input_ids"
            )
    elif "position_ids" in item and inputs:
        positions = np.asarray(item["position_ids"], dtype=np.int64)
        starts = np.flatnonzero(opens_document(positions[1:], positions[:-1])) + 1
        bounds = np.concatenate([[0], starts, [inputs]])
        lengths = torch.from_numpy(np.diff(bounds))
    else:
        lengths = torch.tensor([inputs], dtype=torch.int64)
    if not len(lengths):
        return torch.tensor([inputs + 1], dtype=torch.int64)
    lengths[-1] += 1
    return lengths


def restarting_positions(lengths: torch.Tensor) -> torch.Tensor:
    """0, 1, ... in each run of `lengths` tokens."""
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - torch.repeat_interleave(starts, lengths)


def hf_item(item: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A seq or sft item (input_ids, target_ids, optional loss_mask, position_ids, doc_lengths)
    as `input_ids`, `labels` and `position_ids` restarting at each document."""
    tokens = torch.cat([item["input_ids"][:1], item["target_ids"]]).to(torch.int64)
    labels = tokens.clone()
    if "loss_mask" in item:
        labels[1:][~item["loss_mask"].bool()] = IGNORE_INDEX
    lengths = document_lengths(item)
    labels[torch.cumsum(lengths, 0) - lengths] = IGNORE_INDEX
    return {"input_ids": tokens, "labels": labels, "position_ids": restarting_positions(lengths)}


class HFNamedDataset(Dataset):
    """A tokenmill seq/sft dataset whose items are `hf_item`s: pass it as `train_dataset` to
    transformers' Trainer, with `HFCollator` as its `data_collator`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return hf_item(self.dataset[index])


class HFCollator:
    """Batches of HF items for transformers' Trainer (`data_collator=`): `input_ids`, `labels`,
    `position_ids` and `use_cache=False`, never an attention mask.

    `packed=True` (the default) lays the batch out as one row [1, T], which every attention
    implementation splits into its documents. `packed=False` right-pads the rows to [B, L], the
    padding a run of positions of its own after the real tokens (labels -100): sdpa, eager and
    flex attention split each row, flash-attention kernels do not. `pad_to_multiple_of` pads
    the same way. An item's documents come from its `position_ids`, else TRL's `seq_lengths`
    (what SFTTrainer keeps of a `hf_dataset`), else it is one document."""

    def __init__(
        self, pad_id: int = 0, packed: bool = True, pad_to_multiple_of: int | None = None
    ) -> None:
        if pad_to_multiple_of is not None and pad_to_multiple_of <= 0:
            raise ValueError(f"pad_to_multiple_of must be positive, got {pad_to_multiple_of}")
        self.pad_id = pad_id
        self.packed = packed
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not items:
            raise ValueError("HFCollator: cannot collate an empty batch")
        rows = [self._row(i, item) for i, item in enumerate(items)]
        if self.packed:
            rows = [tuple(torch.cat(parts) for parts in zip(*rows, strict=True))]
        length = max(len(ids) for ids, _, _ in rows)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        padded = [self._pad(row, length) for row in rows]
        ids, labels, positions = (torch.stack(parts) for parts in zip(*padded, strict=True))
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}

    @staticmethod
    def _row(index: int, item: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
        ids = torch.as_tensor(item["input_ids"], dtype=torch.int64)
        if "position_ids" in item:
            positions = torch.as_tensor(item["position_ids"], dtype=torch.int64)
            where = "position_ids"
        elif "seq_lengths" in item:
            lengths = torch.as_tensor(item["seq_lengths"], dtype=torch.int64)
            positions = restarting_positions(lengths)
            where = "seq_lengths"
        else:
            positions, where = torch.arange(len(ids)), ""
        if len(positions) != len(ids):
            raise ValueError(
                f"HFCollator: item {index} has {len(ids)} input_ids and {where} for "
                f"{len(positions)} tokens; something cut the ids alone (SFTTrainer does with "
                "max_length: give it max_length=None, tokenmill's rows are cut already)"
            )
        if "labels" in item:
            labels = torch.as_tensor(item["labels"], dtype=torch.int64)
        else:  # Hugging Face's default: every token but each document's first
            labels = ids.masked_fill(positions == 0, IGNORE_INDEX)
        return ids, labels, positions

    def _pad(self, row: tuple[torch.Tensor, ...], length: int) -> tuple[torch.Tensor, ...]:
        ids, labels, positions = row
        pad = length - len(ids)
        if not pad:
            return row
        return (
            torch.cat([ids, torch.full((pad,), self.pad_id, dtype=torch.int64)]),
            torch.cat([labels, torch.full((pad,), IGNORE_INDEX, dtype=torch.int64)]),
            torch.cat([positions, torch.arange(pad)]),  # a document of its own: seen by none
        )


def hf_dataset(dataset: Any, cache_dir: str | None = None) -> Any:
    """The items as a `datasets.Dataset` with `input_ids`, `labels`, `position_ids` and
    `seq_lengths` (the documents' lengths, TRL's name) columns, for TRL, whose trainers take
    only `datasets` objects. Written once to Arrow files (datasets' cache, or `cache_dir`) a row
    at a time, so the corpus is never all in memory."""
    import datasets  # an optional dependency: only this path needs it

    def rows() -> Iterator[dict[str, list[int]]]:
        for index in range(len(dataset)):
            item = dataset[index]
            row: dict[str, list[int]] = {k: v.tolist() for k, v in hf_item(item).items()}
            row["seq_lengths"] = document_lengths(item).tolist()
            yield row

    ids = datasets.Sequence(datasets.Value("int64"))
    features = datasets.Features(
        {
            "input_ids": ids,
            "labels": ids,
            "position_ids": datasets.Sequence(datasets.Value("int32")),
            "seq_lengths": datasets.Sequence(datasets.Value("int32")),
        }
    )
    fingerprint = getattr(dataset, "fingerprint", None)
    return datasets.Dataset.from_generator(
        rows,
        features=features,
        cache_dir=cache_dir,
        fingerprint=f"{fingerprint}-{HF_LAYOUT}" if fingerprint else None,
    )
