"""HF items and TRL columns, without a model: what they hold, checked against the tools that read
them. A packed row's HF item is its conversations' HF items end to end; transformers' own
packed-sequence detection and TRL's padding-free collator find exactly those conversations in
HFCollator's batches; TRL's preference collators rebuild tokenmill's sequences and train
exactly the tokens tokenmill's masks train."""

from __future__ import annotations

import pytest
import torch
from chat_oracle import packed_chat
from helpers import QWEN, ROOT
from transformers.masking_utils import find_packed_sequence_indices

from tokenmill.dataflow import PackedCollator
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.hf_names import IGNORE_INDEX, HFCollator, hf_dataset, hf_item
from tokenmill.training.trl_columns import dpo_columns, kto_columns, trl_dataset

PAD = 151643  # Qwen2.5's <|endoftext|>, its pad token


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return packed_chat(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def rows(chat):
    return DatasetFactory.load("sft", chat, window_size=512)


@pytest.fixture(scope="module")
def records(chat):
    return DatasetFactory.load("sft", chat, window_size=512, sample="record")


def conversations_of(rows, records) -> list[list[int]]:
    """Record indices of each row: rows hold whole conversations, in stored order."""
    out, at = [], 0
    for index in range(len(rows)):
        count = len(rows[index]["doc_lengths"])
        out.append(list(range(at, at + count)))
        at += count
    assert at == len(records)
    return out


def test_a_rows_hf_item_is_its_conversations_alone_end_to_end(rows, records):
    several = 0
    for index, members in enumerate(conversations_of(rows, records)):
        row = hf_item(rows[index])
        alone = [hf_item(records[k]) for k in members]
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(row[key], torch.cat([item[key] for item in alone])), (index, key)
        several += len(members) > 1
    assert several >= 5


@pytest.mark.parametrize("stored", ["doc_lengths", "position_ids"])
def test_a_documents_first_token_is_never_a_label(stored):
    """Fed alone, a document's first token is predicted by nothing; packed, it would be predicted
    from the document before it. Documents from stored lengths, or where positions jump."""
    ids = torch.arange(10, 18)
    item = {
        "input_ids": ids[:-1],
        "target_ids": ids[1:],
        "loss_mask": torch.ones(7, dtype=torch.bool),
    }
    if stored == "doc_lengths":
        item["doc_lengths"] = torch.tensor([3, 4])
    else:  # a window that opens inside a document: its positions go on from 5
        item["position_ids"] = torch.tensor([5, 6, 7, 0, 1, 2, 3])
    out = hf_item(item)
    assert out["labels"].tolist() == [-100, 11, 12, -100, 14, 15, 16, 17]
    assert out["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("packed", [True, False], ids=["one_row", "padded"])
def test_transformers_finds_exactly_the_conversations_in_a_batch(rows, records, packed):
    members = conversations_of(rows, records)
    picked = [0, 7, 11]  # rows of 2, 3 and 1 conversations
    batch = HFCollator(PAD, packed=packed, pad_to_multiple_of=64)(
        [hf_item(rows[i]) for i in picked]
    )
    assert set(batch) == {"input_ids", "labels", "position_ids", "use_cache"}
    assert batch["use_cache"] is False
    lengths = [[len(records[k]["input_ids"]) + 1 for k in members[i]] for i in picked]
    expected = [sum(lengths, [])] if packed else lengths
    segments = find_packed_sequence_indices(batch["position_ids"])
    for row, want in enumerate(expected):
        found = torch.bincount(segments[row]).tolist()
        pad = batch["input_ids"].shape[1] - sum(want)
        assert found == want + ([pad] if pad else []), row
        if pad:  # the padding: its own run, pad ids, nothing trained
            assert bool((batch["input_ids"][row, -pad:] == PAD).all())
            assert bool((batch["labels"][row, -pad:] == IGNORE_INDEX).all())
    assert batch["input_ids"].shape[1] % 64 == 0


def test_trls_padding_free_collator_sees_the_same_conversations(rows, tmp_path):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    table = hf_dataset(rows, cache_dir=str(tmp_path))
    examples = [{k: table[i][k] for k in ("input_ids", "labels", "seq_lengths")} for i in range(4)]
    trl = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True)(examples)
    ours = HFCollator(PAD)([hf_item(rows[i]) for i in range(4)])
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(trl[key], ours[key]), key
    # SFTTrainer keeps seq_lengths, not position_ids: HFCollator reads either the same way
    assert torch.equal(HFCollator(PAD)(examples)["position_ids"], ours["position_ids"])


@pytest.mark.parametrize("sample", ["row", "window"])
def test_positions_restart_where_packed_collator_starts_documents(chat, sample):
    ds = DatasetFactory.load(
        "sft", chat, window_size=128 if sample == "window" else 512, sample=sample
    )
    for index in range(0, len(ds), max(1, len(ds) // 12)):
        item = ds[index]
        ours = PackedCollator().collate([item])["position_ids"][0]
        assert torch.equal(hf_item(item)["position_ids"][:-1], ours), index


def test_hf_collator_refuses_ids_cut_without_their_positions(rows):
    item = hf_item(rows[0])
    cut = {
        "input_ids": item["input_ids"][:100],
        "labels": item["labels"][:100],
        "seq_lengths": [len(item["input_ids"])],
    }
    with pytest.raises(
        ValueError,
        match=r"item 0 has 100 input_ids and seq_lengths for \d+ tokens.*max_length=None",
    ):
        HFCollator(PAD)([cut])


@pytest.fixture(scope="module")
def preferences(tmp_path_factory):
    """The shipped example DPO pairs and KTO completions under the built-in configs."""
    out = {}
    for kind in ("dpo", "kto"):
        folder = tmp_path_factory.mktemp(kind)
        records = ROOT / "examples" / kind / "records.jsonl"
        Pipeline(default_config(kind), [records], folder, QWEN, workers=1, progress=False).run()
        out[kind] = DatasetFactory.load(kind, folder, window_size=4096, max_len=4096)
    return out


def test_dpo_columns_in_trls_collator_train_tokenmills_masks(preferences):
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    pairs = preferences["dpo"]
    items = [pairs[i] for i in range(len(pairs))]
    batch = DataCollatorForPreference(pad_token_id=PAD)([dpo_columns(item) for item in items])
    n = len(items)
    for side, rows in (("chosen", range(n)), ("rejected", range(n, 2 * n))):
        for item, row in zip(items, rows, strict=True):
            length = len(item[side])
            assert torch.equal(batch["input_ids"][row, :length], item[side])
            assert torch.equal(batch["completion_mask"][row, :length].bool(), item[f"{side}_mask"])
            assert not batch["completion_mask"][row, length:].any()


def test_kto_columns_in_trls_collator_train_tokenmills_masks(preferences):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    completions = preferences["kto"]
    items = [completions[i] for i in range(len(completions))]
    batch = DataCollatorForUnpairedPreference(pad_token_id=PAD)(
        [kto_columns(item) for item in items]
    )
    for row, item in enumerate(items):
        length = len(item["completion"])
        assert torch.equal(batch["input_ids"][row, :length], item["completion"])
        assert torch.equal(batch["completion_mask"][row, :length].bool(), item["completion_mask"])
    assert batch["label"].tolist() == [bool(item["label"]) for item in items]


def test_trl_dataset_writes_the_columns_of_every_item(preferences, tmp_path):
    pairs = preferences["dpo"]
    table = trl_dataset(pairs, cache_dir=str(tmp_path))
    assert table.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]
    assert [table[i] for i in range(len(pairs))] == [
        dpo_columns(pairs[i]) for i in range(len(pairs))
    ]


def test_trl_columns_refuse_what_they_cannot_say():
    tokens = torch.arange(6)
    holed = {"chosen": tokens, "chosen_mask": torch.tensor([0, 0, 1, 0, 1, 1]).bool()}
    holed |= {"rejected": tokens, "rejected_mask": torch.tensor([0, 0, 1, 1, 1, 1]).bool()}
    with pytest.raises(
        ValueError,
        match="item 3: chosen: 1 untrained tokens inside the reply, which starts at token 2",
    ):
        dpo_columns(holed, "item 3")
    apart = dict(holed, chosen_mask=torch.tensor([0, 1, 1, 1, 1, 1]).bool())
    with pytest.raises(
        ValueError, match=r"item 3: chosen and rejected start with different prompts \(1 and 2"
    ):
        dpo_columns(apart, "item 3")
    cut = {"completion": tokens, "completion_mask": torch.zeros(6, dtype=torch.bool), "label": 1.0}
    assert kto_columns(cut) == {"prompt_ids": list(range(6)), "completion_ids": [], "label": True}
