"""Record datasets: one stored record per item (preference pairs, KTO, GRPO groups), read by
offsets; stream datasets (seq, sft) are in datasets.py."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from tokenmill.shards.schema import ITEMS
from tokenmill.training.datasets import BaseDataset


class RecordDataset(BaseDataset):
    """Record types: `len` is the record count; a record's length comes from the offsets of
    its shard when asked for (nothing is held per record), where the store has offsets."""

    length_keys: tuple[str, ...] = ()

    def __init__(self, store: Any, max_len: int = 2048) -> None:
        super().__init__(store, max_len)
        self._lengths: np.ndarray | None = None
        self._spans: bool | None = None  # False: the store cannot measure a record unread

    def __len__(self) -> int:
        return int(self.store.num_rows)

    def _record(self, index: int) -> dict[str, Any]:
        return self.store.fetch_row(self._check_index(index), list(self.keys))

    def _all_lengths(self) -> np.ndarray | None:
        """Per-record token counts summed over `length_keys`, or None if the store cannot say."""
        if self._lengths is None and hasattr(self.store, "row_lengths"):
            try:  # a lazy store has no offsets: lengths are known only once a record is processed
                per_key = [np.asarray(self.store.row_lengths(k)) for k in self.length_keys]
            except ValueError:
                return None
            self._lengths = np.sum([self._capped(n) for n in per_key], axis=0).astype(np.int64)
        return self._lengths

    def _capped(self, lengths: np.ndarray) -> np.ndarray:
        return lengths

    def sample_length(self, index: int) -> int:
        index = self._check_index(index)
        if self._spans is not False and hasattr(self.store, "row_span"):
            try:  # a lazy store has no offsets: lengths are known only once a record is processed
                lengths = [self.store.row_span(index, k)[1] for k in self.length_keys]
                return int(self._capped(np.asarray(lengths, dtype=np.int64)).sum())
            except ValueError:
                self._spans = False
        return self._measure(self[index])

    def _measure(self, item: dict[str, Any]) -> int:
        """Tokens of an item read whole (a lazy store has no offsets): the item schema's count."""
        return ITEMS[self.train_type].token_count(item)

    def _data_identity(self) -> str:
        lengths = self._all_lengths()
        if lengths is None:
            return f"records={len(self)}"
        return "lengths=" + hashlib.sha256(lengths.astype("<i8").tobytes()).hexdigest()


class DPODataset(RecordDataset):
    """Preference pairs: `chosen`, `rejected` and their masks, each cut to `max_len` tokens
    keeping the start (the prompt)."""

    train_type = "dpo"
    keys = ("chosen", "rejected", "chosen_mask", "rejected_mask")
    length_keys = tuple(ITEMS["dpo"].token_keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        record = self._record(index)
        item = {}
        for key in self.keys:
            value = torch.as_tensor(record[key])[: self.max_len]
            item[key] = value.bool() if key.endswith("_mask") else value.long()
        return item

    def _capped(self, lengths: np.ndarray) -> np.ndarray:
        return np.minimum(lengths, self.max_len)


class KTODataset(RecordDataset):
    """Unpaired preference data (TRL's KTO): `completion` (the prompt and the reply as one
    conversation) with its `completion_mask` (the reply trains), cut to `max_len` keeping the
    start, and `label` (1.0 good, 0.0 bad)."""

    train_type = "kto"
    keys = ("completion", "completion_mask", "label")
    length_keys = tuple(ITEMS["kto"].token_keys)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        record = self._record(index)
        return {
            "completion": torch.as_tensor(record["completion"])[: self.max_len].long(),
            "completion_mask": torch.as_tensor(record["completion_mask"])[: self.max_len].bool(),
            "label": torch.as_tensor(record["label"]).to(torch.float32).reshape(()),
        }

    def _capped(self, lengths: np.ndarray) -> np.ndarray:
        return np.minimum(lengths, self.max_len)


class GRPODataset(RecordDataset):
    """GRPO groups: one prompt, a list of responses with their masks, and one reward per
    response. Nothing is truncated: a group is scored as a whole. Prompt-only data (prompts
    for online generation, no responses yet) gives items of `prompts` alone."""

    train_type = "grpo"
    keys = ("prompts",)
    length_keys: tuple[str, ...] = tuple(ITEMS["grpo"].token_keys)  # prompts, responses

    def __init__(self, store: Any, max_len: int = 2048) -> None:
        super().__init__(store, max_len)
        if "responses" in store.keys:
            self._check_keys(store, ("responses", "masks", "rewards"))
        else:
            self.length_keys = ("prompts",)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if "responses" not in self.store.keys:
            prompts = self.store.fetch_row(self._check_index(index), "prompts")
            return {"prompts": torch.as_tensor(prompts).long().reshape(-1)}
        record = self.store.fetch_row(
            self._check_index(index), ["prompts", "responses", "masks", "rewards"]
        )
        responses = [torch.as_tensor(r).long() for r in record["responses"]]
        masks = [torch.as_tensor(m).bool() for m in record["masks"]]
        rewards = torch.as_tensor(record["rewards"]).to(torch.float32).reshape(-1)
        if not len(responses) == len(masks) == len(rewards):
            raise ValueError(
                f"GRPO record {index}: {len(responses)} responses, {len(masks)} masks and "
                f"{len(rewards)} rewards; they must match one to one"
            )
        prompt = torch.as_tensor(record["prompts"]).long().reshape(-1)
        return {"prompts": prompt, "responses": responses, "masks": masks, "rewards": rewards}

    def _cut_params(self) -> str:
        return "untruncated"
