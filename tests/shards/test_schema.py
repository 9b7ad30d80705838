"""The item schema counts tokens and trained tokens of every training type's item alike."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.shards.schema import ITEMS, schema_of, token_count, trained_tokens


def mask(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=bool)


ITEMS_OF = {
    "seq": ({"input_ids": np.arange(6), "target_ids": np.arange(6)}, 6, 6),
    "sft": ({"input_ids": np.arange(4), "loss_mask": mask(0, 1, 1, 0)}, 4, 2),
    "dpo": (
        {
            "chosen": np.arange(3),
            "chosen_mask": mask(0, 1, 1),
            "rejected": np.arange(4),
            "rejected_mask": mask(0, 0, 0, 1),
        },
        7,
        3,
    ),
    "kto": (
        {"completion": np.arange(5), "completion_mask": mask(0, 0, 1, 1, 1), "label": 1.0},
        5,
        3,
    ),
    "grpo": (
        {
            "prompts": np.arange(3),
            "responses": [np.arange(4), np.arange(2)],
            "masks": [mask(1, 1, 1, 1), mask(0, 1)],
            "rewards": np.array([1.0, 0.0]),
        },
        9,
        5,
    ),
}


@pytest.mark.parametrize("train_type", sorted(ITEMS_OF))
def test_every_type_is_told_and_counted(train_type):
    item, tokens, trained = ITEMS_OF[train_type]
    assert schema_of(item) is ITEMS[train_type]
    assert token_count(item) == tokens
    assert trained_tokens(item) == trained


def test_grpo_prompts_alone_count_their_tokens_and_train_none():
    item = {"prompts": np.arange(7)}
    assert (token_count(item), trained_tokens(item)) == (7, 0)


def test_an_unknown_item_is_named_with_every_known_shape():
    with pytest.raises(KeyError, match=r"keys \['text'\] matches no training type.*kto"):
        schema_of({"text": "hello"})
