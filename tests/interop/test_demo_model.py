"""The demo's model keeps packed conversations apart: it masks attention by `cu_seqlens`, so
each conversation of a packed batch scores as it does fed alone."""

from __future__ import annotations

import pytest
import torch
from chat_oracle import packed_chat

from tokenmill.dataflow import PackedCollator
from tokenmill.tools.demo import tiny_model
from tokenmill.training.dataset_factory import DatasetFactory

pytestmark = pytest.mark.slow  # preprocesses shipped chats and runs a model per conversation


def log_probs(model, batch: dict, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per-token log-probability of each target, the model told where documents start."""
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["position_ids"], cu_seqlens)
    scores = torch.log_softmax(logits.double(), -1)
    return scores[0].gather(-1, batch["target_ids"][0, :, None].long())[:, 0]


def test_each_conversation_of_a_packed_batch_scores_as_alone(tmp_path):
    rows = DatasetFactory.load("sft", packed_chat(tmp_path / "sft"), window_size=512)
    batch = PackedCollator().collate([rows[0], rows[1]])
    cu = batch["cu_seqlens"]
    assert len(cu) > 3, "the batch must hold several conversations"
    model = tiny_model(int(batch["input_ids"].max()) + 1).double()
    packed = log_probs(model, batch, cu)
    worst_apart, worst_joined = 0.0, 0.0
    joined = log_probs(model, batch, cu[[0, -1]])  # one document: attention crosses
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone_batch = {k: batch[k][:, a:b] for k in ("input_ids", "target_ids", "position_ids")}
        alone = log_probs(model, alone_batch, torch.tensor([0, b - a], dtype=cu.dtype))
        worst_apart = max(worst_apart, float((packed[a:b] - alone).abs().max()))
        if a > 0:
            worst_joined = max(worst_joined, float((joined[a:b] - alone).abs().max()))
    assert worst_apart < 1e-5
    assert worst_joined > 1e-4  # the oracle can fail: without the mask, conversations mix
