"""Packed SFT rows keep their conversations apart; the oracle is each conversation fed alone.

Shipped chats, preprocessed with the default sft config (whole conversations packed into rows
by the pipeline), are loaded as rows, and rows are packed again into one batch by the loader
(SequentialPackingBatcher + PackedCollator). A tiny random Llama, sdpa and eager, called as
`model(input_ids=..., position_ids=..., use_cache=False)` with no attention mask (as TRL's
trainers call it; with a cache transformers does not look for packed positions) must give each
conversation's per-token loss as when the conversation is fed alone: read from the record
dataset of the same shards, with positions of its own. Without position_ids the same call
lets a later conversation see the earlier ones: the "before", which differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import DATA, QWEN
from torch.utils.data import Subset
from transformers import LlamaConfig, LlamaForCausalLM

from tokenmill.dataflow import (
    DataflowLoader,
    MapDistributor,
    PackedCollator,
    SequentialPackingBatcher,
)
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory

CHATS, BUDGET, ROWS = 40, 4096, 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first shipped chats, preprocessed with the default sft config."""
    root = tmp_path_factory.mktemp("chats")
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        lines = [next(f) for _ in range(CHATS)]
    (root / "chats.jsonl").write_text("".join(lines))
    Pipeline(
        default_config("sft"),
        [root / "chats.jsonl"],
        output_dir=root / "bin",
        tokenizer_path=QWEN,
        workers=1,
        overwrite=True,
        progress=False,
    ).run()
    return root / "bin"


@pytest.fixture(scope="module")
def packed(shards: Path) -> tuple[dict, list[torch.Tensor], list[tuple[int, int]]]:
    """One batch of the loader: the smallest rows of several conversations, packed; and the
    conversations it holds, fed alone (their tokens, their spans [a, b) in the batch)."""
    rows = DatasetFactory.load("sft", shards, window_size=2048)
    records = DatasetFactory.load("sft", shards, window_size=2048, sample="record")
    several = [i for i in range(len(rows)) if len(rows[i]["doc_lengths"]) > 1]
    chosen = sorted(sorted(several, key=rows.sample_length)[:ROWS])
    assert sum(rows.sample_length(i) for i in chosen) <= BUDGET  # one batch
    loader = DataflowLoader(
        MapDistributor(Subset(rows, chosen), shuffle=False, num_epochs=1),
        batcher=SequentialPackingBatcher(BUDGET),
        collator=PackedCollator(),
    )
    (batch,) = list(loader)
    # each conversation of the batch, by where it starts in the token stream
    record_at = {int(s): j for j, s in enumerate(stream_starts(records, range(len(records))))}
    conversations, spans, offset = [], [], 0
    for row in chosen:
        start = int(stream_starts(rows, [row])[0])
        for length in rows[row]["doc_lengths"].tolist():
            record = records[record_at[start]]
            conversations.append(torch.cat([record["input_ids"], record["target_ids"][-1:]]))
            spans.append((offset, offset + length))
            start, offset = start + length, offset + length
    return batch, conversations, spans


def stream_starts(data: Any, indices: Any) -> np.ndarray:
    """Where items start in the token stream (ItemRanges)."""
    ranges = data.item_ranges(np.asarray(list(indices)))
    assert ranges is not None
    return ranges[0]


def compact(ids: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """Token ids as their rank among the data's ids: the model's vocabulary is the data's, so
    its logits stay small (a one-to-one renaming: each sequence keeps its structure)."""
    return torch.searchsorted(vocab, ids)


def tiny_llama(vocab: int, implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        attn_implementation=implementation,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, targets, reduction="none")


@pytest.mark.slow  # a tiny Llama over every conversation alone: seconds
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_each_conversation_of_a_packed_batch_scores_as_alone(packed, implementation):
    batch, conversations, spans = packed
    assert len(conversations) >= 2 * ROWS  # rows of several conversations, several rows
    assert batch["cu_seqlens"].tolist() == [0, *(b for _, b in spans)]
    positions = batch["position_ids"][0]
    vocab = torch.unique(torch.cat([batch["input_ids"][0], batch["target_ids"][0]]))
    model = tiny_llama(len(vocab), implementation)
    inputs, targets = compact(batch["input_ids"], vocab), compact(batch["target_ids"][0], vocab)
    with torch.no_grad():
        together = model(input_ids=inputs, position_ids=batch["position_ids"], use_cache=False)
        before = model(input_ids=inputs, use_cache=False)  # one causal mask over the whole row
    packed_loss = token_losses(together.logits[0], targets)
    before_loss = token_losses(before.logits[0], targets)
    differences, befores = [], []
    for tokens, (a, b) in zip(conversations, spans, strict=True):
        assert torch.equal(batch["input_ids"][0, a:b], tokens[: b - a])  # the same tokens
        assert positions[a:b].tolist() == list(range(b - a))
        with torch.no_grad():
            alone = model(input_ids=compact(tokens[None], vocab), use_cache=False).logits[0]
        alone_loss = token_losses(alone[: b - a], targets[a:b])
        differences.append(float((packed_loss[a:b] - alone_loss).abs().max()))
        befores.append(float((before_loss[a:b] - alone_loss).abs().max()))
        trained = batch["loss_mask"][0, a:b]
        assert trained.any()
        assert torch.allclose(packed_loss[a:b][trained].sum(), alone_loss[trained].sum(), atol=1e-5)
    assert max(differences) < 1e-5, differences
    assert befores[0] < 1e-5  # the first conversation sees nothing before it either way
    assert min(befores[1:]) > 1e-4, befores  # every later one saw the others
