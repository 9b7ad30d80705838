"""What the tests of packed conversations share: the shipped chat data packed by the default SFT
config, tiny Llama models, and the oracle: each conversation's per-token losses fed alone.

A batch is read as what its model call scores: at input position t, the target at t and
whether it trains. A conversation of n tokens is found in a batch row wherever its n - 1 inputs
and n - 1 targets stand, so the oracle needs nothing of how a recipe laid the batch out.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from helpers import QWEN, ROOT
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory

IGNORE = -100
CHUNK = 256  # positions scored per model call: bounds the [B, CHUNK, vocab] float64 logits


def packed_chat(out: Path, records: int = 24, seq_len: int = 256, packed_len: int = 512) -> Path:
    """The first `records` shipped conversations under the default SFT config (bfd packing, each
    row whole conversations), cut to `seq_len` and packed into rows of `packed_len` so that
    float64 runs stay small."""
    config = copy.deepcopy(DEFAULT_CONFIGS["sft"])
    config["preprocessing"].update(
        max_items=records, max_seq_len=seq_len, max_packed_len=packed_len
    )
    Pipeline(
        PipelineConfig.from_dict(config),
        [ROOT / "data" / "chat_sharegpt_1000.jsonl"],
        out,
        QWEN,
        workers=1,
        on_error="skip",
        progress=False,
    ).run()
    return out


def tiny_llama(vocab: int, attn: str = "sdpa", dtype: torch.dtype = torch.float64):
    """A 2-layer Llama with grouped-query attention, seeded, in eval mode."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=4096,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    assert model.config._attn_implementation == attn
    return model


def hf_scored(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, trained) of a batch in Hugging Face's names: the model shifts labels."""
    ids, labels = batch["input_ids"], batch["labels"]
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
    trained = torch.cat(
        [labels[:, 1:] != IGNORE, torch.zeros_like(ids[:, :1], dtype=torch.bool)], 1
    )
    return ids, targets, trained


def tokenmill_scored(batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, trained) of a batch in tokenmill's names: already shifted."""
    return batch["input_ids"], batch["target_ids"], batch["loss_mask"].bool()


class Conversations:
    """Every conversation of an SFT dataset alone (`sample="record"`: one document each, by
    the shards' stored boundaries): its tokens, which of its targets train, and its per-token
    losses under a model it is fed to alone."""

    def __init__(self, out: Path, window_size: int) -> None:
        records = DatasetFactory.load("sft", out, window_size=window_size, sample="record")
        self.tokens: list[torch.Tensor] = []
        self.trained: list[torch.Tensor] = []
        for index in range(len(records)):
            item = records[index]
            self.tokens.append(torch.cat([item["input_ids"][:1], item["target_ids"]]))
            self.trained.append(item["loss_mask"].bool())
        # conversations open alike (a template's system prompt): they are told apart, and looked
        # for at each place of a batch in one dict lookup, by a run of inputs past the opening
        self.probe_end = min(40, min(len(tokens) for tokens in self.tokens) - 1)
        self.probe = slice(max(0, self.probe_end - 16), self.probe_end)
        self.by_probe: dict[tuple[int, ...], list[int]] = {}
        for k, tokens in enumerate(self.tokens):
            self.by_probe.setdefault(tuple(tokens[self.probe].tolist()), []).append(k)
        self._alone: dict[tuple[int, int], torch.Tensor] = {}

    def find(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[tuple[int, int]]:
        """(conversation, input offset) of each conversation whose inputs and targets stand in
        this batch row, in order."""
        found, at, end = [], 0, len(inputs)
        ids = inputs.tolist()
        while at + self.probe_end <= end:
            match = None
            key = tuple(ids[at + self.probe.start : at + self.probe_end])
            for k in self.by_probe.get(key, []):
                tokens, n = self.tokens[k], len(self.tokens[k])
                if at + n - 1 > end or (match is not None and n <= match[1]):
                    continue
                if torch.equal(inputs[at : at + n - 1], tokens[:-1]) and torch.equal(
                    targets[at : at + n - 1], tokens[1:]
                ):
                    match = (k, n)
            if match is None:
                at += 1
                continue
            found.append((match[0], at))
            at += match[1] - 1
        return found

    def alone(self, model: Any, k: int) -> torch.Tensor:
        """Conversation k's losses at its trained targets, fed alone as a plain sequence."""
        key = (id(model), k)
        if key not in self._alone:
            tokens, trained = self.tokens[k], self.trained[k]
            at = torch.nonzero(trained).flatten()
            with torch.no_grad():
                logits = model(input_ids=tokens[None, :-1], logits_to_keep=at).logits[0]
            self._alone[key] = torch.nn.functional.cross_entropy(
                logits.double(), tokens[1:][at], reduction="none"
            )
        return self._alone[key]

    def worst(self, model: Any, call: dict[str, Any], scored: tuple[torch.Tensor, ...]) -> dict:
        """The largest |packed - alone| per-token loss of the conversations in a batch, scored by
        `model(**call)` at each position (`logits_to_keep`: the same forward pass, the LM head
        only where a target trains). Checks that the batch trains exactly each conversation's
        trained targets, no other token, and counts conversations that follow another in a row."""
        inputs, targets, trained = scored
        rows = [self.find(inputs[r], targets[r]) for r in range(len(inputs))]
        places: list[tuple[int, int, int, torch.Tensor]] = []
        for r, row in enumerate(rows):
            for k, at in row:
                n = len(self.tokens[k])
                assert torch.equal(trained[r, at : at + n - 1], self.trained[k]), (r, k, at)
                places.append((r, k, at, at + torch.nonzero(self.trained[k]).flatten()))
        counted = sum(int(self.trained[k].sum()) for _, k, _, _ in places)
        assert counted == int(trained.sum()), "the batch trains tokens of no conversation"
        positions = sorted({int(p) for *_, at in places for p in at})
        losses: dict[tuple[int, int], float] = {}
        for begin in range(0, len(positions), CHUNK):
            keep = torch.tensor(positions[begin : begin + CHUNK])
            with torch.no_grad():
                logits = model(**call, logits_to_keep=keep).logits.double()
            ce = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), targets[:, keep].flatten(), reduction="none"
            ).view(len(inputs), len(keep))
            for j, p in enumerate(keep.tolist()):
                for r in range(len(inputs)):
                    losses[(r, p)] = float(ce[r, j])
        worst, later = 0.0, 0
        for r, k, at, trained_at in places:
            packed = torch.tensor([losses[(r, int(p))] for p in trained_at], dtype=torch.float64)
            if len(packed):
                worst = max(worst, float((packed - self.alone(model, k)).abs().max()))
            later += at > 0
        return {"worst": worst, "conversations": len(places), "after_another": later}
