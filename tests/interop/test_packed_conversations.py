"""What the model sees: inside a packed batch, every conversation is scored as if fed alone.

The default SFT item is a stored row of several whole conversations. Through each recipe of
docs/training.md (transformers' Trainer, TRL's SFTTrainer padded, padding-free and packed, the
plain torch loop), a tiny float64 Llama (sdpa and eager attention) is called the way that
recipe calls it on the batches it makes, and each conversation's per-token losses equal its
losses fed alone to 1e-5 (chat_oracle). Called as the recipes were before (an attention mask
over the row, or no position ids), later conversations see earlier ones and the losses move.
"""

from __future__ import annotations

import warnings

import pytest
from chat_oracle import (
    Conversations,
    hf_scored,
    packed_chat,
    tiny_llama,
    tokenmill_scored,
)
from helpers import QWEN
from transformers import AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainingArguments

from tokenmill.dataflow import DataflowLoader, MapDistributor, PackedCollator
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.hf_names import HFCollator, HFNamedDataset, hf_dataset

pytestmark = [
    pytest.mark.slow,  # float64 forward passes over a 151k-token vocabulary, trainers built
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

ATTENTION = ["sdpa", "eager"]
APART = 1e-5  # float64: packed and alone agree to rounding
SEEN = 1e-3  # a conversation that sees another moves far more than this


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return packed_chat(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def rows(data):
    return DatasetFactory.load("sft", data, window_size=512)


@pytest.fixture(scope="module")
def records(data):
    return DatasetFactory.load("sft", data, window_size=512, sample="record")


@pytest.fixture(scope="module")
def conversations(data):
    return Conversations(data, 512)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(QWEN)


@pytest.fixture(scope="module", params=ATTENTION)
def model(request, tokenizer):
    return tiny_llama(len(tokenizer), request.param)


def without(batch: dict, *keys: str) -> dict:
    return {k: v for k, v in batch.items() if k not in keys}


def apart(result: dict) -> None:
    assert result["after_another"] >= 1, result  # the batch packs conversations together
    assert result["worst"] <= APART, result


def test_the_data_packs_several_conversations_a_row(rows, records):
    per_row = [len(rows[i]["doc_lengths"]) for i in range(len(rows))]
    assert sum(per_row) == len(records) and max(per_row) >= 2


@pytest.mark.parametrize("packed", [True, False], ids=["one_row", "padded"])
def test_transformers_trainer_batches(rows, tokenizer, model, conversations, tmp_path, packed):
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, report_to=[], use_cpu=True, seed=1
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=HFNamedDataset(rows),
        data_collator=HFCollator(tokenizer.pad_token_id, packed=packed),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch and batch["use_cache"] is False
    # Trainer.compute_loss calls model(**inputs); the labels only feed the model's own loss
    apart(conversations.worst(model, without(batch, "labels"), hf_scored(batch)))
    # the same call without position ids, and today's padding collator, let them see each other
    seen = conversations.worst(model, without(batch, "labels", "position_ids"), hf_scored(batch))
    assert seen["worst"] > SEEN
    items = [HFNamedDataset(rows)[i] for i in range(2)]
    old = DataCollatorForSeq2Seq(tokenizer)(
        [{k: item[k].tolist() for k in ("input_ids", "labels")} for item in items]
    )
    assert conversations.worst(model, without(old, "labels"), hf_scored(old))["worst"] > SEEN


@pytest.mark.parametrize("recipe", ["padded", "padding_free", "packed"])
def test_trl_sft_trainer_batches(rows, records, tokenizer, model, conversations, tmp_path, recipe):
    from trl import SFTConfig, SFTTrainer

    options: dict = {"max_length": None}
    collator = None
    if recipe == "padded":  # tokenmill's rows, padded by HFCollator: no attention mask
        train, collator = rows, HFCollator(tokenizer.pad_token_id, packed=False)
    elif recipe == "padding_free":  # tokenmill's rows, laid in one row by TRL's own collator
        train, options["padding_free"] = rows, True
    else:  # conversations alone, packed by TRL (BFD) into rows of 512
        train, options = records, {"packing": True, "max_length": 512}
    args = SFTConfig(
        str(tmp_path / "out"),
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        seed=1,
        **options,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=hf_dataset(train, cache_dir=str(tmp_path / "cache")),
        processing_class=tokenizer,
        data_collator=collator,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert "attention_mask" not in batch
    # SFTTrainer.compute_loss sets use_cache=False and calls model(**inputs)
    call = {**without(batch, "labels"), "use_cache": False}
    apart(conversations.worst(model, call, hf_scored(batch)))
    seen = conversations.worst(model, without(call, "position_ids"), hf_scored(batch))
    assert seen["worst"] > SEEN


@pytest.mark.parametrize("collator", ["fitting", "packed"])
def test_plain_loop_batches(rows, tokenizer, model, conversations, collator):
    chosen = None if collator == "fitting" else PackedCollator(pad_id=tokenizer.pad_token_id)
    loader = DataflowLoader(
        MapDistributor(rows, seed=42, num_epochs=1), batch_size=2, collator=chosen
    )
    batch = next(iter(loader))
    if collator == "fitting":  # rows vary in length: the loader pads them (SFTPaddingCollator)
        assert "attention_mask" in batch
    # docs/training.md's loop: position ids, no attention mask, no cache
    call = {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "use_cache": False,
    }
    apart(conversations.worst(model, call, tokenmill_scored(batch)))
    if collator == "fitting":  # the loop as it was: the padding mask over the whole row
        old = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        assert conversations.worst(model, old, tokenmill_scored(batch))["worst"] > SEEN


def test_a_cache_turns_the_split_off(rows, tokenizer, conversations):
    """Why every recipe says use_cache=False: with a cache, transformers ignores the positions'
    restarts and the conversations see each other again."""
    model = tiny_llama(len(tokenizer), "sdpa")
    assert model.config.use_cache
    batch = HFCollator(tokenizer.pad_token_id)([HFNamedDataset(rows)[i] for i in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cached = conversations.worst(model, without(batch, "labels", "use_cache"), hf_scored(batch))
    assert cached["worst"] > SEEN
    apart(conversations.worst(model, without(batch, "labels"), hf_scored(batch)))
