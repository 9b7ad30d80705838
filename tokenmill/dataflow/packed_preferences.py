"""Packed preference collators: a DPO, KTO or GRPO group's sequences in one row [1, T] for
variable-length attention, as PackedCollator packs seq/sft samples.

Each sequence (a DPO side, a KTO completion, a GRPO prompt followed by one of its responses)
is one document of the row, shifted as tokenmill's seq/sft items are: `input_ids` its tokens
but the last, `target_ids` its tokens but the first, `loss_mask` its mask on those targets (a
sequence's first token has no context: a padded batch never scores it either). The row has
PackedCollator's keys (`position_ids` restarting at 0 per sequence, `cu_seqlens`,
`max_seqlen`, `num_tokens`, `pad_to`) and what says which sequence is which. Sequence s's
log-probability, what DPO, KTO and GRPO losses take, is the sum over its segment
[cu_seqlens[s], cu_seqlens[s + 1]) of log p(target_ids) where loss_mask: the same as from a
padded batch, with no token spent on padding.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenmill.dataflow.collators import BatchCollator, PackedCollator, require_keys
from tokenmill.shards.schema import schema_of

__all__ = ["PackedDPOCollator", "PackedKTOCollator", "PackedGRPOCollator", "packed_tokens"]


def packed_tokens(item: dict[str, Any]) -> int:
    """Tokens an item puts in a packed row: each of its sequences but the first token, a GRPO
    response with its prompt again (seq/sft items: their `input_ids`). Give it as a packing
    batcher's `size_fn` so that a group fills the row to `pad_to` and no further."""
    schema = schema_of(item)
    if schema.train_type in ("seq", "sft"):
        return schema.token_count(item)
    if schema.grouped:
        context = sum(len(item[key]) for key in schema.context)
        return sum(max(context + len(s) - 1, 0) for key in schema.tokens for s in item[key])
    return sum(max(len(item[key]) - 1, 0) for key in schema.tokens)


class _PackedSequences(BatchCollator):
    """A row of sequences with their masks, each a document (PackedCollator's keys)."""

    name = ""

    def __init__(self, pad_id: int = 0, label_pad_id: int = -100, pad_to: int | None = None):
        self.packer = PackedCollator(pad_id, label_pad_id, pad_to)  # lays out the row

    def _row(self, sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        samples = []
        for s, (tokens, mask) in enumerate(sequences):
            if len(tokens) != len(mask):
                raise ValueError(
                    f"{self.name}: sequence {s} has {len(tokens)} tokens and a mask of "
                    f"{len(mask)}; they must match one to one"
                )
            samples.append(
                {"input_ids": tokens[:-1], "target_ids": tokens[1:], "loss_mask": mask[1:].bool()}
            )
        total = sum(len(s["input_ids"]) for s in samples)
        pad_to = self.packer.pad_to
        if pad_to is not None and total > pad_to:
            raise ValueError(
                f"{self.name}: group has {total} tokens, over pad_to={pad_to}; batch with "
                "a token budget no larger than pad_to, and size_fn=packed_tokens"
            )
        return self.packer.collate(samples)


class PackedDPOCollator(_PackedSequences):
    """Preference pairs in one row, in the order chosen_0, rejected_0, chosen_1, ...:
    `chosen_index` and `rejected_index` [B] are pair i's sequences (segments of cu_seqlens),
    so pair i's log-ratio is `logps[chosen_index[i]] - logps[rejected_index[i]]`."""

    name = "PackedDPOCollator"

    def collate(self, samples: list[dict]) -> dict:
        sides = ("chosen", "rejected")
        require_keys(samples, [*sides, "chosen_mask", "rejected_mask"], self.name)
        batch = self._row([(s[side], s[f"{side}_mask"]) for s in samples for side in sides])
        pairs = torch.arange(len(samples), dtype=torch.long) * 2
        batch["chosen_index"], batch["rejected_index"] = pairs, pairs + 1
        return batch


class PackedKTOCollator(_PackedSequences):
    """KTO completions in one row, sequence i item i's, with `label` [B] (1.0 desirable)."""

    name = "PackedKTOCollator"

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["completion", "completion_mask", "label"], self.name)
        batch = self._row([(s["completion"], s["completion_mask"]) for s in samples])
        labels = [torch.as_tensor(s["label"], dtype=torch.float32).reshape(()) for s in samples]
        batch["label"] = torch.stack(labels)
        return batch


class PackedGRPOCollator(_PackedSequences):
    """GRPO groups in one row: each response after its own copy of its group's prompt (one
    document each, as a padded batch runs prompt + response per row), group after group.
    `group_ids` [S] is each sequence's group (its item in the batch) and `rewards` [S] its
    response's reward; the mask trains the response only."""

    name = "PackedGRPOCollator"

    def collate(self, samples: list[dict]) -> dict:
        require_keys(samples, ["prompts", "responses", "masks", "rewards"], self.name)
        sequences, groups, rewards = [], [], []
        for b, s in enumerate(samples):
            prompt = s["prompts"]
            context = torch.zeros(len(prompt), dtype=torch.bool)
            for response, mask in zip(s["responses"], s["masks"], strict=True):
                sequences.append((torch.cat([prompt, response]), torch.cat([context, mask.bool()])))
            groups += [b] * len(s["responses"])
            rewards.append(torch.as_tensor(s["rewards"], dtype=torch.float32).reshape(-1))
        batch = self._row(sequences)
        batch["group_ids"] = torch.tensor(groups, dtype=torch.long)
        batch["rewards"] = torch.cat(rewards)
        return batch
