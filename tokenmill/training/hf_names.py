"""Items in the names Hugging Face trainers take: transformers' Trainer and TRL's SFTTrainer.

tokenmill's items are already shifted (`input_ids` -> `target_ids`, `loss_mask` on targets);
Hugging Face causal LMs shift `labels` themselves. An HF item holds a sample's W + 1 tokens as
`input_ids` and the same ids as `labels`, -100 (cross-entropy's ignore index) where tokenmill
takes no loss: the first token, and each target the loss mask leaves out. The model's own
shift then scores exactly tokenmill's targets, the last one included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

IGNORE_INDEX = -100


def hf_item(item: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A seq or sft item (input_ids, target_ids, optional loss_mask) as input_ids and labels."""
    tokens = torch.cat([item["input_ids"][:1], item["target_ids"]])
    labels = tokens.clone()
    labels[0] = IGNORE_INDEX
    if "loss_mask" in item:
        labels[1:][~item["loss_mask"].bool()] = IGNORE_INDEX
    return {"input_ids": tokens, "labels": labels}


class HFNamedDataset(Dataset):
    """A tokenmill seq/sft dataset whose items are `hf_item`s: pass it as `train_dataset` to
    transformers' Trainer (with `DataCollatorForSeq2Seq` to pad rows of different lengths)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return hf_item(self.dataset[index])


def hf_dataset(dataset: Any, cache_dir: str | None = None) -> Any:
    """The items as a `datasets.Dataset` with `input_ids` and `labels` columns, for TRL, whose
    trainers take only `datasets` objects. Written once to Arrow files (datasets' cache, or
    `cache_dir`) a row at a time, so the corpus is never all in memory."""
    import datasets  # an optional dependency: only this path needs it

    def rows() -> Iterator[dict[str, list[int]]]:
        for index in range(len(dataset)):
            yield {k: v.tolist() for k, v in hf_item(dataset[index]).items()}

    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "labels": datasets.Sequence(datasets.Value("int64")),
        }
    )
    fingerprint = getattr(dataset, "fingerprint", None)
    return datasets.Dataset.from_generator(
        rows, features=features, cache_dir=cache_dir, fingerprint=fingerprint
    )
