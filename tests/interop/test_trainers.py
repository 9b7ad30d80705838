"""tokenmill data in the trainers people use, with no glue code: transformers' Trainer and TRL's
SFTTrainer (with and without packing) train a tiny model on shipped SFT data, and the loss the
Hugging Face names give equals tokenmill's own masked loss on the same model (the oracle)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from helpers import ROOT
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from tokenmill.dataflow import SFTPaddingCollator
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import DEFAULT_CONFIGS
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.hf_names import IGNORE_INDEX, HFNamedDataset, hf_dataset, hf_item

TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"
pytestmark = [
    pytest.mark.slow,  # real trainers: a few steps each
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
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
    return DatasetFactory.load("sft", out, window_size=256)


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


def test_hf_names_score_exactly_tokenmills_targets(rows, tokenizer):
    model = tiny_model(tokenizer).eval()
    items = [rows[i] for i in range(4)]
    ours = SFTPaddingCollator(pad_id=tokenizer.pad_token_id).collate(items)
    targets = ours["target_ids"].masked_fill(~ours["loss_mask"], IGNORE_INDEX)
    hf = DataCollatorForSeq2Seq(tokenizer)(
        [{k: v.tolist() for k, v in hf_item(i).items()} for i in items]
    )
    assert int((hf["labels"] != IGNORE_INDEX).sum()) == int(ours["loss_mask"].sum())
    with torch.no_grad():
        logits = model(input_ids=ours["input_ids"], attention_mask=ours["attention_mask"]).logits
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
        data_collator=DataCollatorForSeq2Seq(tokenizer),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trl_sft_trainer_trains_on_tokenmill_rows(rows, tokenizer, tmp_path, packing):
    from trl import SFTConfig, SFTTrainer

    train = hf_dataset(rows, cache_dir=str(tmp_path / "cache"))
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=2,
        packing=packing,
        max_length=256,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
    )
    trainer = SFTTrainer(
        model=tiny_model(tokenizer), args=args, train_dataset=train, processing_class=tokenizer
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
