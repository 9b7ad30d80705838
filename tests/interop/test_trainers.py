"""tokenmill data in the trainers people use, with no glue code: transformers' Trainer and TRL's
SFTTrainer (padded, padding-free and packed) train a tiny model on shipped SFT rows, and the loss
the Hugging Face names give equals tokenmill's own masked loss over the same rows packed by
PackedCollator (the oracle). That every conversation inside is scored as if alone is
test_packed_conversations.py's."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import ROOT
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from tokenmill.dataflow import PackedCollator
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.hf_names import (
    IGNORE_INDEX,
    HFCollator,
    HFNamedDataset,
    hf_dataset,
    hf_item,
)

TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"
pytestmark = [
    pytest.mark.slow,  # real trainers: a few steps each
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """Packed SFT rows of the first 16 shipped conversations, cut to 256 tokens, written by the real pipeline."""
    out = tmp_path_factory.mktemp("sft")
    config = copy.deepcopy(DEFAULT_CONFIGS["sft"])
    config["preprocessing"].update(max_items=16, max_seq_len=256, max_packed_len=256)
    Pipeline(
        PipelineConfig.from_dict(config),
        [ROOT / "data" / "chat_sharegpt_1000.jsonl"],
        out,
        TOKENIZER,
        workers=1,
        on_error="skip",
        progress=False,
    ).run()
    return out


@pytest.fixture(scope="module")
def rows(sft):
    return DatasetFactory.load("sft", sft, window_size=256)


@pytest.fixture(scope="module")
def records(sft):
    """The same conversations one by one, for TRL to pack."""
    return DatasetFactory.load("sft", sft, window_size=256, sample="record")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def tiny_model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("packed", [True, False], ids=["one_row", "padded"])
def test_hf_names_score_exactly_tokenmills_targets(rows, tokenizer, packed):
    model = tiny_model(tokenizer).eval()
    items = [rows[i] for i in range(4)]
    ours = PackedCollator(pad_id=tokenizer.pad_token_id).collate(items)
    targets = ours["target_ids"].masked_fill(~ours["loss_mask"], IGNORE_INDEX)
    hf = HFCollator(tokenizer.pad_token_id, packed=packed)([hf_item(i) for i in items])
    # a conversation's first token never trains in these rows (a template's opening), so the
    # HF labels, which never train it, are exactly tokenmill's targets
    assert int((hf["labels"] != IGNORE_INDEX).sum()) == int(ours["loss_mask"].sum())
    with torch.no_grad():
        logits = model(
            input_ids=ours["input_ids"], position_ids=ours["position_ids"], use_cache=False
        ).logits
        expected = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX
        )
        loss = model(**hf).loss
    assert math.isclose(float(loss), float(expected), rel_tol=1e-5)


def test_transformers_trainer_trains_on_tokenmill_rows(rows, tokenizer, tmp_path):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = Trainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=HFNamedDataset(rows),
        data_collator=HFCollator(tokenizer.pad_token_id),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)


@pytest.mark.parametrize("recipe", ["padded", "padding_free", "packed"])
def test_trl_sft_trainer_trains_on_tokenmill_rows(rows, records, tokenizer, tmp_path, recipe):
    from trl import SFTConfig, SFTTrainer

    # rows: padded by HFCollator, or laid in one row by TRL's padding-free collator; both take
    # max_length=None, as the rows are cut already. Conversations alone: packed by TRL.
    options: dict = {"max_length": None, "padding_free": recipe == "padding_free"}
    if recipe == "packed":
        options = {"packing": True, "max_length": 256}
    collator = HFCollator(tokenizer.pad_token_id, packed=False) if recipe == "padded" else None
    train = hf_dataset(records if recipe == "packed" else rows, cache_dir=str(tmp_path / "cache"))
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        **options,
    )
    trainer = SFTTrainer(
        model=tiny_model(tokenizer),
        args=args,
        train_dataset=train,
        processing_class=tokenizer,
        data_collator=collator,
    )
    # TRL keeps the labels it is given: every trained token of tokenmill's rows, once
    prepared = trainer.train_dataset
    trained = sorted(t for row in prepared["labels"] for t in row if t != IGNORE_INDEX)
    expected = sorted(t for row in train["labels"] for t in row if t != IGNORE_INDEX)
    assert trained == expected
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert result.global_step == 2 and math.isfinite(result.training_loss)
