"""Datasets over shards written by the real pipeline from the shipped data.

Every route of DatasetFactory.load is exercised on real files: offline .bin shards
for all four types, eager raw JSONL for seq/sft and lazy raw JSONL for dpo/grpo;
for the same records and config, both routes must give identical items.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import ROOT
from tokenizers import Tokenizer
from torch.utils.data import DataLoader

from tokenmill.dataflow.collators import SFTPaddingCollator
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.training.dataset_factory import DATASETS, DatasetFactory
from tokenmill.training.datasets import SEQDataset, SFTDataset
from tokenmill.training.record_datasets import DPODataset, GRPODataset

DATA = ROOT / "data"
TOKENIZER = DATA / "tokenizers" / "qwen2.5"
IM_START, IM_END = 151644, 151645  # Qwen2.5 "<|im_start|>", "<|im_end|>"
WINDOW = 64

# train type -> (shipped file, records used)
INPUTS = {
    "seq": ("pretrain_c4_300.jsonl", 6),
    "sft": ("chat_sharegpt_1000.jsonl", 5),
    "dpo": ("dpo_en_300.jsonl", 6),
    "grpo": ("grpo_from_dpo_300.jsonl", 6),
}


def raw_lines(train_type: str) -> list[dict]:
    name, count = INPUTS[train_type]
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(count)]


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The first records of each shipped file, as a raw .jsonl file of their own."""
    paths = {}
    for train_type in INPUTS:
        folder = tmp_path_factory.mktemp(f"raw_{train_type}")
        paths[train_type] = folder / "data.jsonl"
        paths[train_type].write_text("".join(json.dumps(r) + "\n" for r in raw_lines(train_type)))
    return paths


@pytest.fixture(scope="module")
def shards(raw: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Offline .bin datasets written by the real pipeline with each type's default config."""
    from tokenmill.preprocess.run.pipeline import Pipeline

    out = {}
    for train_type, path in raw.items():
        out[train_type] = tmp_path_factory.mktemp(f"bin_{train_type}")
        Pipeline(
            default_config(train_type),
            [path],
            output_dir=out[train_type],
            tokenizer_path=TOKENIZER,
            workers=1,
            overwrite=True,
        ).run()
    return out


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))


def load(train_type: str, path: Path, **kwargs):
    """The dataset at `path`; sft as stream windows (the sample modes have their own tests)."""
    if train_type == "sft":
        kwargs.setdefault("sample", "window")
    return DatasetFactory.load(
        train_type, path, window_size=WINDOW, tokenizer_path=TOKENIZER, **kwargs
    )


def assert_items_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], list):
            assert len(a[key]) == len(b[key]), key
            for x, y in zip(a[key], b[key], strict=True):
                assert x.dtype == y.dtype and torch.equal(x, y), key
        else:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# --- routes -------------------------------------------------------------------------------


@pytest.mark.parametrize("train_type", list(INPUTS))
def test_bin_route_gives_the_right_class_and_store(train_type: str, shards: dict[str, Path]):
    from tokenmill.training.mmap_store import MmapStore

    ds = load(train_type, shards[train_type])
    assert type(ds) is DATASETS[train_type]
    assert isinstance(ds.store, MmapStore)
    if train_type in ("seq", "sft"):
        assert len(ds) == ds.store.num_windows > 0
    else:
        assert len(ds) == ds.store.num_rows == INPUTS[train_type][1]


@pytest.mark.parametrize("train_type", list(INPUTS))
def test_bin_and_raw_jsonl_routes_give_identical_items(
    train_type: str, shards: dict[str, Path], raw: dict[str, Path]
):
    if train_type == "seq":  # eager through dataset_config.json beside the data
        config = default_config("seq").model_dump(mode="json")
        config["tokenizer_path"] = str(TOKENIZER)
        (raw["seq"].parent / "dataset_config.json").write_text(json.dumps(config))
    offline = load(train_type, shards[train_type])
    online = load(train_type, raw[train_type])
    assert type(online.store).__name__ == "JsonlStore"
    assert len(offline) == len(online) > 0
    for i in range(len(offline)):
        assert_items_equal(offline[i], online[i])
        assert offline.sample_length(i) == online.sample_length(i)


@pytest.mark.parametrize("train_type", list(INPUTS))
def test_pipeline_jsonl_output_loads_as_pretokenized_records(
    train_type: str, shards: dict[str, Path], raw: dict[str, Path], tmp_path: Path
):
    from tokenmill.preprocess.run.pipeline import Pipeline

    config = default_config(train_type).model_dump(mode="json")
    config["output"]["storage_format"] = "jsonl"
    Pipeline(
        PipelineConfig.from_dict(config),
        [raw[train_type]],
        output_dir=tmp_path,
        tokenizer_path=TOKENIZER,
        workers=1,
    ).run()
    written, offline = load(train_type, tmp_path), load(train_type, shards[train_type])
    assert type(written.store).__name__ == "JsonlStore" and not written.store.lazy
    assert len(written) == len(offline) > 0
    for i in range(len(offline)):
        assert_items_equal(written[i], offline[i])


def test_prebuilt_store_bypasses_path_and_format(shards: dict[str, Path]):
    store = load("sft", shards["sft"]).store
    ds = DatasetFactory.load("seq", "/nonexistent/path", window_size=7, store=store)
    assert (
        DatasetFactory.load("sft", "/nonexistent", 7, store=store, sample="window").store is store
    )
    assert type(ds) is SEQDataset and ds.store is store
    assert torch.equal(ds[0]["input_ids"], load("sft", shards["sft"])[0]["input_ids"])


# --- items --------------------------------------------------------------------------------


def test_seq_windows_are_the_token_stream_shifted_by_one(
    shards: dict[str, Path], tokenizer: Tokenizer
):
    eos = IM_END  # the tokenizer's eos_token
    stream: list[int] = []
    for record in raw_lines("seq"):
        stream += tokenizer.encode(record["text"], add_special_tokens=True).ids + [eos]
    ds = load("seq", shards["seq"])
    assert ds[0]["input_ids"].tolist() == stream[:WINDOW]
    assert ds[0]["target_ids"].tolist() == stream[1 : WINDOW + 1]
    assert ds[3]["input_ids"].tolist() == stream[3 * WINDOW : 4 * WINDOW]
    half = load("seq", shards["seq"], stride=WINDOW // 2)
    assert (
        half[3]["target_ids"].tolist() == stream[3 * WINDOW // 2 + 1 : 3 * WINDOW // 2 + WINDOW + 1]
    )
    assert ds[0]["input_ids"].dtype == torch.long
    last = ds[len(ds) - 1]
    assert len(last["input_ids"]) == len(last["target_ids"]) == WINDOW


def test_sft_loss_mask_is_aligned_with_targets(shards: dict[str, Path], tokenizer: Tokenizer):
    ds = load("sft", shards["sft"], stride=1)
    assert len(ds) == ds.store.token_count - WINDOW
    item = ds[0]
    assert item["loss_mask"].dtype == torch.bool and item["position_ids"].dtype == torch.long
    assert item["position_ids"].tolist() == list(range(WINDOW))  # first record starts the stream
    # a target that opens a turn never trains: the role header is masked (train_spans: turn);
    # the assistant's first content token, three targets on, trains
    assistant = tokenizer.token_to_id("assistant")
    opened = {}
    for i in range(len(ds)):
        item = ds[i]
        targets, mask = item["target_ids"].tolist(), item["loss_mask"].tolist()
        for k in range(WINDOW - 1):
            if targets[k] == IM_START and k + 3 < WINDOW:
                is_assistant = targets[k + 1] == assistant
                opened.setdefault(is_assistant, set()).update(mask[k : k + 3])
                if is_assistant:
                    opened.setdefault("content", set()).add(mask[k + 3])
    assert opened == {True: {False}, False: {False}, "content": {True}}


def test_dpo_items_and_truncation_keep_the_start(shards: dict[str, Path]):
    full, cut = load("dpo", shards["dpo"], max_len=100_000), load("dpo", shards["dpo"], max_len=40)
    for i in range(len(full)):
        a, b = full[i], cut[i]
        assert {k: v.dtype for k, v in a.items()} == {
            "chosen": torch.long,
            "rejected": torch.long,
            "chosen_mask": torch.bool,
            "rejected_mask": torch.bool,
        }
        for key in a:
            assert torch.equal(b[key], a[key][:40])
        assert len(a["chosen"]) == len(a["chosen_mask"]) > 40
        # ends on the assistant's trained end of turn, "<|im_end|>\n"
        assert a["chosen"][-2:].tolist() == [IM_END, 198] and a["chosen_mask"][-2:].all()
        assert cut.sample_length(i) == len(b["chosen"]) + len(b["rejected"]) == 80
        assert full.sample_length(i) == len(a["chosen"]) + len(a["rejected"])


def test_grpo_items_hold_the_group(shards: dict[str, Path], tokenizer: Tokenizer):
    ds = load("grpo", shards["grpo"])
    eos = tokenizer.token_to_id("<|im_end|>")
    assert eos == IM_END
    for i, record in enumerate(raw_lines("grpo")):
        item = ds[i]
        assert type(ds) is GRPODataset
        assert item["rewards"].dtype == torch.float32
        assert item["rewards"].tolist() == record["rewards"]
        assert tokenizer.decode(item["prompts"].tolist(), skip_special_tokens=False).endswith(
            "<|im_start|>assistant\n"
        )
        assert len(item["responses"]) == len(item["masks"]) == len(record["responses"])
        for resp, mask, text in zip(
            item["responses"], item["masks"], record["responses"], strict=True
        ):
            assert resp.dtype == torch.long and mask.dtype == torch.bool and bool(mask.all())
            assert resp[-1] == eos
            assert tokenizer.decode(resp[:-1].tolist()) == text
        sizes = len(item["prompts"]) + sum(len(r) for r in item["responses"])
        assert ds.sample_length(i) == sizes


# --- errors, fingerprint, loader ----------------------------------------------------------


def test_store_without_a_required_key_fails_at_construction(shards: dict[str, Path]):
    seq_store = load("seq", shards["seq"]).store
    with pytest.raises(
        ValueError,
        match=r"SFTDataset needs store keys \['loss_mask'\].*available keys: "
        r"\['doc_lengths', 'position_ids', 'sequence'\]",
    ):
        DatasetFactory.create("sft", store=seq_store)
    with pytest.raises(ValueError, match=r"DPODataset needs store keys \['chosen', 'rejected'"):
        DPODataset(seq_store)


def test_unknown_names_and_keywords_raise(shards: dict[str, Path]):
    with pytest.raises(
        ValueError,
        match=r"unknown train_type 'pretrain'; valid: \['dpo', 'grpo', 'kto', 'seq', 'sft'\]",
    ):
        DatasetFactory.load("pretrain", shards["seq"], window_size=WINDOW)
    with pytest.raises(TypeError, match="window"):
        DatasetFactory.create("seq", store=load("seq", shards["seq"]).store, window=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tokenizer"):
        DatasetFactory.load("seq", shards["seq"], window_size=WINDOW, tokenizer="x")  # type: ignore[call-arg]
    with pytest.raises(IndexError, match="out of range"):
        load("dpo", shards["dpo"])[6]


def test_fingerprint_follows_data_and_cut(shards: dict[str, Path]):
    a, b = load("sft", shards["sft"]), load("sft", shards["sft"])
    assert isinstance(a.fingerprint, str) and a.fingerprint == b.fingerprint
    assert a.fingerprint != load("sft", shards["sft"], stride=WINDOW // 2).fingerprint
    assert a.fingerprint != load("seq", shards["sft"]).fingerprint
    assert (
        load("dpo", shards["dpo"]).fingerprint != load("dpo", shards["dpo"], max_len=40).fingerprint
    )
    assert load("dpo", shards["dpo"]).fingerprint != load("grpo", shards["grpo"]).fingerprint


def test_sample_length_matches_items(shards: dict[str, Path]):
    for train_type in ("seq", "sft"):
        ds = load(train_type, shards[train_type])
        assert [ds.sample_length(i) for i in range(len(ds))] == [WINDOW] * len(ds)


def test_dataloader_workers_read_the_shards(shards: dict[str, Path]):
    ds = load("sft", shards["sft"])
    assert type(ds) is SFTDataset
    collate = SFTPaddingCollator()
    loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=collate)
    batches = list(loader)
    assert len(batches) == -(-len(ds) // 4)
    for n, batch in enumerate(batches):
        want = collate([ds[i] for i in range(4 * n, min(4 * n + 4, len(ds)))])
        for key in want:
            assert torch.equal(batch[key], want[key]), key


# --- whole-conversation samples -------------------------------------------------------------


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """200 shipped chats written with the sft defaults: rows of whole conversations."""
    from tokenmill.preprocess.run.pipeline import Pipeline

    folder = tmp_path_factory.mktemp("chats")
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        lines = [next(f) for _ in range(200)]
    (folder / "in.jsonl").write_text("".join(lines))
    Pipeline(
        default_config("sft"), [folder / "in.jsonl"], folder / "out", TOKENIZER, workers=1
    ).run()
    return folder / "out", [json.loads(line) for line in lines]


def test_no_sft_sample_starts_mid_conversation(chats):
    """Row and record samples (the default and the padded one) start where a conversation
    does, and a row's stored boundaries put every document start on one too."""
    out, _ = chats
    rows = DatasetFactory.load("sft", out, window_size=2048)
    records = DatasetFactory.load("sft", out, window_size=2048, sample="record")
    assert rows.sample == "row" and len(rows) < len(records) <= 200
    for ds in (rows, records):
        for i in range(len(ds)):
            item = ds[i]
            assert item["input_ids"][0] == IM_START, (ds.sample, i)
            assert int(item["doc_lengths"].sum()) == len(item["input_ids"]) == ds.sample_length(i)
            starts = torch.cumsum(item["doc_lengths"], 0)[:-1]
            assert (item["input_ids"][starts] == IM_START).all()
            assert (item["position_ids"][starts] == 0).all() and item["position_ids"][0] == 0
    assert sum(len(rows[i]["input_ids"]) + 1 for i in range(len(rows))) == rows.store.token_count


@pytest.mark.slow  # masks the shipped chats again
def test_record_samples_are_each_conversation_alone(chats):
    """Record i is conversation i as the pipeline's masker makes it, shifted by one."""
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer
    from tokenmill.preprocess.document.masking import RecordMasker

    out, raw = chats
    masker = RecordMasker(default_config("sft"), load_tokenizer(TOKENIZER))
    ds = DatasetFactory.load("sft", out, window_size=2048, sample="record")
    manifest_skipped = sum(
        json.loads((out / "manifest.json").read_text())["summary"]["skipped"].values()
    )
    kept = []
    for record in raw:
        try:
            kept.append(masker.process(record))
        except ValueError:
            continue
    assert len(kept) == len(ds) == len(raw) - manifest_skipped
    for i in (0, 1, len(ds) // 2, len(ds) - 1):
        want, item = kept[i], ds[i]
        assert item["input_ids"].tolist() == want["sequence"][:-1].tolist()
        assert item["target_ids"].tolist() == want["sequence"][1:].tolist()
        assert item["loss_mask"].tolist() == want["loss_mask"][1:].tolist()


def test_a_row_longer_than_the_sample_is_refused_by_name(chats):
    out, _ = chats
    with pytest.raises(ValueError, match=r"rows are longer than the sample \(64 \+ 1 tokens\)"):
        DatasetFactory.load("sft", out, window_size=64)
    with pytest.raises(ValueError, match="sample must be one of"):
        DatasetFactory.load("sft", out, window_size=2048, sample="turn")
    with pytest.raises(ValueError, match="sample= is for sft data"):
        DatasetFactory.load("seq", out, window_size=64, sample="row")


def test_record_samples_join_the_pieces_of_a_document_packed_across_rows(tmp_path):
    """`stream` packing cuts conversations at row ends (and shard ends): record samples put
    each one back together from the stored boundaries, and `tokenmill inspect` and the
    Megatron export find the same documents (one rule: shards/format.py's opens_document);
    row samples, which would start mid-conversation, are refused by name."""
    from tokenmill.preprocess.run.pipeline import Pipeline
    from tokenmill.tools.convert import export_megatron
    from tokenmill.tools.inspect import dataset_stats
    from tokenmill.tools.megatron import read_megatron

    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        (tmp_path / "in.jsonl").write_text("".join(next(f) for _ in range(20)))
    config = default_config("sft").model_dump(mode="json")
    config["preprocessing"].update(packing_strategy="stream", max_packed_len=300)
    config["output"].update(max_tokens_per_shard=1000)
    out = tmp_path / "out"
    summary = Pipeline(
        PipelineConfig.from_dict(config), [tmp_path / "in.jsonl"], out, TOKENIZER, workers=1
    ).run()
    assert summary.shards > 2
    records = DatasetFactory.load("sft", out, window_size=2048, sample="record")
    assert len(records) == summary.records_written
    assert all(records[i]["input_ids"][0] == IM_START for i in range(len(records)))
    assert sum(records.sample_length(i) + 1 for i in range(len(records))) == summary.tokens
    lengths = [records.sample_length(i) + 1 for i in range(len(records))]
    stats = dataset_stats(out)["domains"][""]
    assert stats["documents"] == len(lengths)
    assert stats["document_length"]["max"] == max(lengths)
    export_megatron(out, tmp_path / "mg" / "corpus", tokens_only=True)
    assert read_megatron(tmp_path / "mg" / "corpus").lengths.tolist() == lengths
    with pytest.raises(ValueError, match="rows start inside a document"):
        DatasetFactory.load("sft", out, window_size=2048)


def test_truncating_a_row_sample_cuts_its_boundaries_too(chats):
    from tokenmill.dataflow import PackedCollator, TruncateProcessor

    out, _ = chats
    rows = DatasetFactory.load("sft", out, window_size=2048)
    index = next(i for i in range(len(rows)) if len(rows[i]["doc_lengths"]) > 1)
    item = rows[index]
    first = int(item["doc_lengths"][0])
    cut = TruncateProcessor(first + 3).process(item)
    assert cut["doc_lengths"].tolist() == [first, 3]
    assert PackedCollator().collate([cut])["cu_seqlens"].tolist() == [0, first, first + 3]
    bad = {**item, "input_ids": item["input_ids"][:5], "target_ids": item["target_ids"][:5]}
    with pytest.raises(ValueError, match="doc_lengths sum to"):
        PackedCollator().collate([bad])


@pytest.fixture(scope="module")
def two_tokenizers(raw: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same records preprocessed with two tokenizers of different families."""
    from tokenmill.preprocess.run.pipeline import Pipeline

    out = {}
    for name in ("qwen2.5", "deepseek-v3"):
        out[name] = tmp_path_factory.mktemp(f"seq_{name}")
        Pipeline(
            default_config("seq"),
            [raw["seq"]],
            output_dir=out[name],
            tokenizer_path=DATA / "tokenizers" / name,
            workers=1,
            overwrite=True,
        ).run()
    return out


def test_mixing_data_of_two_tokenizers_is_refused_naming_both(two_tokenizers):
    from tokenmill.dataflow import MapDistributor, MixtureDistributor, RankPartitionedDistributor

    qwen, deepseek = (
        DatasetFactory.load("seq", two_tokenizers[n], window_size=WINDOW)
        for n in ("qwen2.5", "deepseek-v3")
    )
    assert qwen.tokenizer_provenance[1].endswith("qwen2.5")
    sources = [MapDistributor(qwen), MapDistributor(deepseek)]
    with pytest.raises(
        ValueError, match=r"source 0 was tokenized with .*qwen2\.5 .* source 1 with .*deepseek-v3"
    ):
        MixtureDistributor(sources, [1, 1])
    with pytest.raises(ValueError, match="allow_mixed_tokenizers=True"):
        RankPartitionedDistributor(sources, [1, 1])
    MixtureDistributor(sources, [1, 1], allow_mixed_tokenizers=True)  # on purpose
    MixtureDistributor(
        [MapDistributor(qwen), MapDistributor(load("seq", two_tokenizers["qwen2.5"]))], [1, 1]
    )


def test_loading_with_another_tokenizer_than_the_data_was_made_with_warns(two_tokenizers):
    path = two_tokenizers["qwen2.5"]
    with pytest.warns(
        UserWarning, match=r"made with the tokenizer at .*qwen2\.5.*loaded with .*deepseek-v3"
    ):
        DatasetFactory.load(
            "seq", path, window_size=WINDOW, tokenizer_path=DATA / "tokenizers" / "deepseek-v3"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DatasetFactory.load("seq", path, window_size=WINDOW, tokenizer_path=TOKENIZER)
