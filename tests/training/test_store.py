"""Stores read back exactly what the shard writer wrote, across shards, in DataLoader workers."""

import copy
import json
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.shards.manifest import write_manifest
from tokenmill.shards.verify import verify_dataset
from tokenmill.shards.writer import ShardWriter
from tokenmill.training.factory import StoreFactory, detect_format
from tokenmill.training.jsonl_store import JsonlStore
from tokenmill.training.mmap_store import MmapStore
from tokenmill.training.store import window_bounds, window_count

ROOT = ROOT
SFT = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
DPO = {"chosen": "int32", "chosen_mask": "bool", "rejected": "int32", "rejected_mask": "bool"}
GRPO = {"prompts": "int32", "responses": "int32", "masks": "bool", "rewards": "float32"}
LENGTHS = [5, 9, 1, 12, 7, 3, 8, 30, 2, 6, 11, 4]  # 98 tokens


def write(root: Path, records, dtypes, primary, max_tokens, domain=""):
    with ShardWriter(root / domain, dtypes, primary, max_tokens) as writer:
        for record in records:
            writer.add(record)
    return writer.published


def sft_records():
    rng = np.random.default_rng(0)
    for n in LENGTHS:
        ids = rng.integers(0, 150_000, n)
        yield {"sequence": ids, "loss_mask": ids % 3 > 0, "position_ids": np.arange(n)}


def grpo_records(n=9):
    for i in range(n):
        responses = [np.arange(i + j) + 10 * j for j in range(i % 3 + 1)]
        yield {
            "prompts": np.full(i + 1, i),
            "responses": responses,
            "masks": [r % 2 == 0 for r in responses],
            "rewards": np.linspace(0, 1, len(responses), dtype=np.float32),
        }


def dpo_records(n=7):
    for i in range(n):
        chosen, rejected = np.arange(i + 2) * 3, np.arange(i % 4 + 1) + 1000
        yield {
            "chosen": chosen,
            "chosen_mask": chosen > 3,
            "rejected": rejected,
            "rejected_mask": rejected % 2 == 0,
        }


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    infos = write(root, list(sft_records()), SFT, "sequence", 20)
    write_manifest(root, {"primary_key": "sequence", "domains": {"": infos}})
    return root


@pytest.fixture(scope="module")
def sft_store(sft_dir):
    return StoreFactory.create("bin", window_size=8, stride=5).load(sft_dir)


def concatenated(key):
    return np.concatenate([r[key] for r in sft_records()])


# --- window maths ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tokens, window, stride, count",
    [
        (10, 4, 4, 2),
        (9, 4, 4, 2),
        (8, 4, 4, 1),
        (5, 4, 4, 1),
        (4, 4, 4, 0),
        (0, 4, 4, 0),
        (10, 4, 2, 3),
        (10, 4, 6, 1),
        (98, 8, 5, 18),
    ],
)
def test_window_count(tokens, window, stride, count):
    assert window_count(tokens, window, stride) == count


@given(st.integers(0, 500), st.integers(1, 50), st.integers(1, 50))
def test_every_window_has_its_target_token_and_no_window_is_missed(tokens, window, stride):
    n = window_count(tokens, window, stride)
    if n:
        assert window_bounds(n - 1, window, stride)[1] + 1 <= tokens  # the shifted target exists
    assert window_bounds(n, window, stride)[1] + 1 > tokens  # one more window would not fit


# --- reading back exactly ---------------------------------------------------------------------
def test_stream_store_reads_back_every_key(sft_store):
    assert len(sft_store._views) == 6  # the rolling cut 98 tokens into 6 shards
    assert sft_store.keys == list(SFT) and sft_store.token_count == 98 and sft_store.num_rows == 12
    assert sft_store.num_windows == len(sft_store) == (98 - 1 - 8) // 5 + 1 == 18
    assert sft_store.window_at(3) == (15, 23)
    item = sft_store[3]
    assert item["sequence"].dtype == torch.int32 and item["loss_mask"].dtype == torch.bool
    for key in SFT:
        assert item[key].tolist() == concatenated(key)[15:23].tolist()
    assert sft_store.fetch(0, 98, "position_ids").tolist() == concatenated("position_ids").tolist()
    assert sft_store.fetch(40, 40, "sequence").shape == (0,)
    assert sft_store.row_lengths("sequence").tolist() == LENGTHS


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 98), st.integers(0, 98))
def test_cross_shard_fetch_equals_concatenation(sft_store, a, b):
    begin, end = min(a, b), max(a, b)
    got = sft_store.fetch(begin, end, ["sequence", "loss_mask"])
    assert got["sequence"].numpy().tolist() == concatenated("sequence")[begin:end].tolist()
    assert got["loss_mask"].numpy().tolist() == concatenated("loss_mask")[begin:end].tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 97), max_size=30))
def test_gather_across_shards_equals_indexing_the_concatenation(sft_store, indices):
    got = sft_store.gather("position_ids", np.asarray(indices, dtype=np.int64))
    assert got.tolist() == concatenated("position_ids")[indices].tolist()


def test_gather_outside_the_stream_fails(sft_store):
    with pytest.raises(IndexError, match="gather of key 'sequence' outside \\[0, 98\\)"):
        sft_store.gather("sequence", np.asarray([97, 98]))


def test_fetch_record_across_shards(sft_store):
    records = list(sft_records())
    for i, record in enumerate(records):
        got = sft_store.fetch_row(i, ["sequence", "loss_mask"])
        assert got["sequence"].tolist() == record["sequence"].tolist()
        assert got["loss_mask"].tolist() == record["loss_mask"].tolist()
    assert sft_store.fetch_row(11, "position_ids").tolist() == [0, 1, 2, 3]


def test_out_of_range_and_unknown_keys(sft_store):
    with pytest.raises(
        IndexError, match="fetch \\[90, 99\\) of key 'sequence' outside \\[0, 98\\)"
    ):
        sft_store.fetch(90, 99, "sequence")
    with pytest.raises(IndexError, match="row 12 out of range \\[0, 12\\)"):
        sft_store.fetch_row(12, "sequence")
    with pytest.raises(IndexError, match="window 18 out of range \\[0, 18\\)"):
        sft_store.window_at(18)
    with pytest.raises(KeyError, match="key 'tokens' is not in this store; keys: \\['sequence'"):
        sft_store.fetch(0, 1, "tokens")


def test_record_keys_and_list_keys_across_shards(tmp_path):
    write(tmp_path, list(dpo_records()), DPO, "chosen", 10, domain="dpo")
    write(tmp_path, list(grpo_records()), GRPO, "prompts", 6, domain="grpo")
    dpo = StoreFactory.create("bin").load(tmp_path / "dpo")
    assert dpo.num_rows == len(dpo) == 7 and len(dpo._views) == 5
    for i, record in enumerate(dpo_records()):
        got = dpo.fetch_row(i, list(DPO))
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in record.items()}
    grpo = StoreFactory.create("bin").load(tmp_path / "grpo")
    assert grpo.token_count == sum(range(1, 10)) and len(grpo._views) > 3
    for i, record in enumerate(grpo_records()):
        got = grpo.fetch_row(i, list(GRPO))
        assert [r.tolist() for r in got["responses"]] == [r.tolist() for r in record["responses"]]
        assert [m.dtype for m in got["masks"]] == [torch.bool] * len(record["masks"])
        assert [m.tolist() for m in got["masks"]] == [m.tolist() for m in record["masks"]]
        assert (
            got["rewards"].dtype == torch.float32
            and got["rewards"].tolist() == record["rewards"].tolist()
        )
    assert grpo.row_lengths("responses").tolist() == [
        sum(len(r) for r in rec["responses"]) for rec in grpo_records()
    ]
    with pytest.raises(ValueError, match="grpo/shard_00000: keys .* differ from dpo/shard_00000's"):
        StoreFactory.create("bin").load(tmp_path)


def test_fetch_copies_only_the_window_and_warns_nothing(sft_store):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        window = sft_store.fetch(0, 4, "sequence")  # inside shard 0: a slice of the memmap
        record = sft_store.fetch_row(0, "sequence")
    for part in ("values", "offsets"):  # read-only maps of the files, nothing loaded per record
        array = getattr(sft_store._columns(0)["sequence"], part)
        assert (
            isinstance(array.base, np.memmap)
            and array.base.mode == "r"
            and not array.flags.writeable
        )
    window[0] = -1
    record[0] = -1
    assert sft_store.fetch(0, 1, "sequence").item() == concatenated("sequence")[0] != -1


# --- load-time checks -----------------------------------------------------------------------------
def test_before_load_the_store_says_so():
    store = StoreFactory.create("bin", window_size=4)
    for call in (
        lambda: store.fetch(0, 1, "sequence"),
        lambda: store.fetch_row(0, "sequence"),
        lambda: store.keys,
    ):
        with pytest.raises(RuntimeError, match="Store not loaded"):
            call()


def test_truncated_bin_fails_at_load_and_bad_offsets_at_the_shards_first_read(tmp_path):
    write(tmp_path, list(sft_records()), SFT, "sequence", 20)
    shard = tmp_path / "shard_00003"
    with open(shard / "loss_mask.bin", "r+b") as f:
        f.truncate(3)
    with pytest.raises(
        ValueError, match=f"^{shard / 'loss_mask.bin'}: key 'loss_mask': 3 bytes, expected 30 bytes"
    ):
        MmapStore().load(tmp_path)
    (shard / "loss_mask.bin").write_bytes(bytes(30))
    with open(shard / "position_ids.offsets.bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(
        ValueError,
        match=f"^{shard / 'position_ids.offsets.bin'}: key 'position_ids': 8 bytes, expected 16",
    ):
        MmapStore().load(tmp_path)
    np.array([0, 13], "<i8").tofile(shard / "position_ids.offsets.bin")
    store = MmapStore().load(tmp_path)  # sizes are right; the shard is mapped on first use
    with pytest.raises(
        ValueError,
        match="position_ids.offsets.bin: key 'position_ids': runs 0 .. 13, expected 0 .. 30",
    ):
        for i in range(store.num_rows):
            store.fetch_row(i, "sequence")


def test_manifest_listing_a_missing_shard_fails_at_load(sft_dir, tmp_path):
    manifest = json.loads((sft_dir / "manifest.json").read_text())
    manifest["domains"][""].append({"name": "shard_00099", "records": 1, "tokens": 1})
    write_manifest(tmp_path, manifest)
    for p in sft_dir.glob("shard_*"):
        shutil.copytree(p, tmp_path / p.name)
    with pytest.raises(
        ValueError, match="shards listed in manifest.json are missing: \\['shard_00099'\\]"
    ):
        MmapStore().load(tmp_path)


def seed_shard(folder: Path, arrays: dict, offsets: dict) -> None:
    """A shard as the seed writer left it: {key: {shape, dtype}} and optional inline offsets."""
    folder.mkdir(parents=True)
    meta = {}
    for key, arr in arrays.items():
        arr.tofile(folder / f"{key}.bin")
        meta[key] = {"shape": [len(arr)], "dtype": arr.dtype.name}
        if key in offsets:
            meta[key]["offsets"] = offsets[key]
    (folder / "meta.json").write_text(json.dumps(meta))


def test_seed_style_shards_load(tmp_path):
    seed_shard(
        tmp_path / "dpo" / "0",
        {"chosen": np.arange(6, dtype=np.int32), "rejected": np.arange(3, dtype=np.int64)},
        {"chosen": [0, 2, 6], "rejected": [0, 1, 3]},
    )
    seed_shard(
        tmp_path / "dpo" / "1",
        {"chosen": np.arange(2, dtype=np.int32), "rejected": np.arange(9, dtype=np.int64)},
        {"chosen": [0, 2], "rejected": [0, 9]},
    )
    store = StoreFactory.create("bin").load(tmp_path / "dpo")
    assert store.num_rows == 3 and store.fetch_row(1, "chosen").tolist() == [2, 3, 4, 5]
    assert store.fetch_row(2, "rejected").tolist() == list(range(9))
    assert store.fetch(4, 7, "chosen").tolist() == [4, 5, 0]
    assert verify_dataset(tmp_path / "dpo", require_manifest=False) == [] and store.verify() == []
    seed_shard(tmp_path / "seq" / "a", {"sequence": np.arange(10, dtype=np.int32)}, {})
    stream = StoreFactory.create("bin", window_size=4).load(tmp_path / "seq")
    assert (
        stream.num_rows == 0 and len(stream) == 2 and stream[1]["sequence"].tolist() == [4, 5, 6, 7]
    )
    with pytest.raises(IndexError, match="row 0 out of range \\[0, 0\\)"):
        stream.fetch_row(0, "sequence")


def test_offsets_beyond_2_32_tokens(tmp_path):
    """Record positions past 2**31 and 2**32 int32 tokens, in a sparse 16 GiB file that costs no disk."""
    shard = tmp_path / "shard_00000"
    shard.mkdir()
    n = 2**32 + 40
    starts = [0, 2**31 + 3, 2**31 + 8, 2**32 + 5, 2**32 + 30, n]  # records 0 and 2 are huge
    with open(shard / "sequence.bin", "wb") as f:
        f.truncate(n * 4)
        for s in (2**31 + 3, 2**32 + 5, 2**32 + 30):
            f.seek(s * 4)
            f.write(np.arange(7, 12, dtype="<i4").tobytes())
    np.array(starts, "<i8").tofile(shard / "sequence.offsets.bin")
    meta = {
        "sequence": {
            "shape": [n],
            "dtype": "int32",
            "nbytes": n * 4,
            "offsets": {"file": "sequence.offsets.bin", "count": len(starts)},
        }
    }
    (shard / "meta.json").write_text(json.dumps(meta))
    store = StoreFactory.create("bin", window_size=2**20).load(tmp_path)
    assert store.token_count == n and store.num_rows == 5
    assert store.fetch_row(1, "sequence").tolist() == [7, 8, 9, 10, 11]
    assert store.fetch_row(3, "sequence").tolist() == [7, 8, 9, 10, 11] + [0] * 20
    assert store.fetch_row(4, "sequence").tolist() == [7, 8, 9, 10, 11] + [0] * 5
    assert store.fetch(2**32 + 29, 2**32 + 33, "sequence").tolist() == [0, 7, 8, 9]
    assert store.row_lengths("sequence").tolist() == [2**31 + 3, 5, 2**31 - 3, 25, 10]
    assert len(store) == (n - 1 - 2**20) // 2**20 + 1 == 4096


# --- DataLoader workers ------------------------------------------------------------------------------
def test_dataloader_workers_read_the_same_windows(sft_store):
    assert len(pickle.dumps(sft_store)) < 20_000  # paths and metadata, never the mapped data
    clone = copy.deepcopy(sft_store)  # __getstate__/__setstate__, as pickling to a worker
    assert clone[17]["sequence"].tolist() == sft_store[17]["sequence"].tolist()
    loader = torch.utils.data.DataLoader(sft_store, batch_size=4, num_workers=2)
    batches = list(loader)
    assert len(batches) == 5 and batches[-1]["sequence"].shape == (2, 8)
    got = torch.cat([b["sequence"] for b in batches])
    want = np.stack([concatenated("sequence")[i * 5 : i * 5 + 8] for i in range(18)])
    assert got.tolist() == want.tolist()


# --- format detection and the factory ------------------------------------------------------------------
def test_detect_format(tmp_path, sft_dir):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "a.json").write_text("{}\n")
    (tmp_path / "nested" / "deep").mkdir(parents=True)
    (tmp_path / "nested" / "deep" / "b.jsonl").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "only_bin").mkdir()
    (tmp_path / "only_bin" / "x.bin").write_bytes(b"")
    assert detect_format(sft_dir) == "bin"
    assert detect_format(tmp_path / "a.jsonl") == "jsonl"
    assert detect_format(tmp_path / "nested") == "jsonl"
    assert detect_format(tmp_path) == "jsonl"  # *.bin without meta.json is not a shard
    with pytest.raises(ValueError, match="cannot load a .json file"):
        detect_format(tmp_path / "a.json")
    with pytest.raises(FileNotFoundError, match="no shards .* and no \\*.jsonl files"):
        detect_format(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        detect_format(tmp_path / "missing")


def test_store_factory():
    assert (
        type(StoreFactory.create("bin")) is MmapStore
        and type(StoreFactory.create("jsonl")) is JsonlStore
    )
    store = StoreFactory.create("jsonl", window_size=16)
    assert (store.window_size, store.stride) == (16, 16)
    with pytest.raises(
        ValueError, match="unknown storage type 'parquet'; valid: \\['bin', 'jsonl'\\]"
    ):
        StoreFactory.create("parquet")
    with pytest.raises(
        TypeError,
        match="unknown keyword\\(s\\) \\['window'\\]; valid: \\['window_size', 'stride'\\]",
    ):
        StoreFactory.create("bin", window=16)
    with pytest.raises(ValueError, match="stride needs window_size"):
        StoreFactory.create("bin", stride=3)
    with pytest.raises(ValueError, match="window_size must be a positive int"):
        StoreFactory.create("bin", window_size=0)


# --- JSONL --------------------------------------------------------------------------------------------
def write_jsonl(path: Path, lines) -> Path:
    path.write_text(
        "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    )
    return path


def char_transform(record):
    ids = np.frombuffer(record["text"].encode(), np.uint8).astype(np.int32)
    return {"sequence": ids, "loss_mask": ids != ord(" ")}


def test_jsonl_eager_transform_over_a_folder(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [{"text": "cd e"}])
    write_jsonl(tmp_path / "a.jsonl", [{"text": "ab"}, "\n", {"text": "x"}])
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "sub" / "c.jsonl", [{"text": "ignored: not top level"}])
    store = StoreFactory.create("jsonl", window_size=3).load(tmp_path, transform=char_transform)
    assert store.num_rows == 3 and store.token_count == 7 and len(store) == 2
    assert bytes(store.fetch(0, 7, "sequence").numpy().astype(np.uint8)) == b"abxcd e"
    assert store.fetch_row(2, "loss_mask").tolist() == [True, True, False, True]
    assert store[1]["sequence"].tolist() == [ord(c) for c in "cd "]


def test_jsonl_lazy_processor_indexes_lines_only(tmp_path):
    calls = []

    def processor(record):
        calls.append(record["text"])
        return char_transform(record)

    path = write_jsonl(
        tmp_path / "data.jsonl", [{"text": "hello"}, "\n", "  \n", {"text": "hi"}, "not json\n"]
    )
    store = JsonlStore().load(path, processor=processor)
    assert store.num_rows == len(store) == 3 and calls == []
    assert store._line_pos.dtype == np.int64 and store._line_pos.tolist() == [0, 22, 37]
    assert store.fetch_row(1, "sequence").tolist() == [104, 105] and calls == ["hi"]
    assert store.keys == ["sequence", "loss_mask"]
    with pytest.raises(ValueError, match=f"^{path}:5: invalid JSON at column 1"):
        store.fetch_row(2, "sequence")
    with pytest.raises(ValueError, match="reads records only"):
        store.fetch(0, 1, "sequence")


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "ok"}, "\n", "[1, 2]\n"])
    with pytest.raises(ValueError, match=f"^{path}:3: expected a JSON object, got array"):
        JsonlStore().load(path, transform=char_transform)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": "ok"}, {"txt": "typo"}])
    with pytest.raises(ValueError, match=f"^{path}:2: 'text'"):
        JsonlStore().load(path, transform=char_transform)
    with pytest.raises(ValueError, match="field 'text' is not a list of numbers; give transform="):
        JsonlStore().load(path)


def test_jsonl_storage_format_reads_back_like_bin(tmp_path):
    """The pipeline's `storage_format: jsonl` output loads as pre-tokenized records with its dtypes."""
    records = list(grpo_records())
    for fmt in ("bin", "jsonl"):
        with ShardWriter(tmp_path / fmt / "web", GRPO, "prompts", 12, storage_format=fmt) as writer:
            for record in records:
                writer.add(record)
        manifest = {"storage_format": fmt, "keys": GRPO, "domains": {"web": writer.published}}
        write_manifest(tmp_path / fmt, manifest)
    (tmp_path / "jsonl" / "rejects.jsonl").write_text('{"source": "x"}\n')
    assert detect_format(tmp_path / "jsonl") == "jsonl"
    binary, text = MmapStore().load(tmp_path / "bin"), JsonlStore().load(tmp_path / "jsonl")
    assert text.num_rows == binary.num_rows == 9 and text.keys == binary.keys
    for i in range(9):
        a, b = binary.fetch_row(i, list(GRPO)), text.fetch_row(i, list(GRPO))
        assert a["prompts"].equal(b["prompts"]) and a["rewards"].equal(b["rewards"])
        assert all(x.equal(y) for x, y in zip(a["masks"], b["masks"], strict=True))
        assert all(x.equal(y) for x, y in zip(a["responses"], b["responses"], strict=True))


# --- JSONL through a PipelineConfig and a real tokenizer ---------------------------------------------
TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"


def chats(tmp_path: Path, n: int) -> Path:
    lines = (ROOT / "data" / "chat_sharegpt_1000.jsonl").read_text().splitlines(keepends=True)[:n]
    return write_jsonl(tmp_path / "chat.jsonl", lines)


def masker(train_type):
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer
    from tokenmill.preprocess.document.masking import RecordMasker
    from tokenmill.preprocess.presets import default_config

    return RecordMasker(default_config(train_type), load_tokenizer(TOKENIZER))


def test_jsonl_builtin_messages_transform(tmp_path):
    path = chats(tmp_path, 6)
    want = [masker("sft").process(json.loads(line)) for line in path.read_text().splitlines()]
    with open(path, "a") as f:  # under min_chars (50): filtered and counted, not an error
        f.write(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo"},
                    ]
                }
            )
            + "\n"
        )
    store = JsonlStore().load(path, tokenizer_path=TOKENIZER)
    assert store.keys == ["sequence", "loss_mask", "position_ids"] and store.num_rows == 6
    assert store.skipped == {"too_short": 1}
    for i, record in enumerate(want):
        got = store.fetch_row(i, store.keys)
        assert got["loss_mask"].dtype == torch.bool and got["sequence"].dtype == torch.int32
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in record.items()}
    first = store.fetch_row(0, ["sequence", "loss_mask"])
    assert first["sequence"][:3].tolist() == [
        151644,
        8948,
        198,
    ]  # <|im_start|>system\n (the default system prompt)
    assert not first["loss_mask"][:3].any() and first["loss_mask"].any()


def test_jsonl_dataset_config_beside_the_data(tmp_path):
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.document.masking import RecordMasker

    path = chats(tmp_path, 3)
    config = {
        "input": {"sections": [{"field": "messages", "template": True, "action": "train"}]},
        "preprocessing": {"min_chars": 1},
        "output": {"position_ids_mode": "none"},
    }
    relative = str(TOKENIZER.relative_to(ROOT))
    (tmp_path / "dataset_config.json").write_text(
        json.dumps({**config, "tokenizer_path": relative})
    )
    (tmp_path / "data").symlink_to(ROOT / "data")  # the relative tokenizer_path resolves here
    store = JsonlStore().load(path)
    assert store.keys == ["sequence", "loss_mask"] and store.num_rows == 3
    process = RecordMasker(PipelineConfig.from_dict(config), load_tokenizer(TOKENIZER)).process
    for i, line in enumerate(path.read_text().splitlines()):
        want = process(json.loads(line))
        got = store.fetch_row(i, store.keys)
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}
    assert store.fetch_row(0, "sequence")[:3].tolist() == [151644, 8948, 198]


def test_jsonl_lazy_dpo_processor_with_real_tokenizer(tmp_path):
    """The route DatasetFactory takes for raw DPO: each record tokenized on fetch, errors located."""
    lines = (ROOT / "data" / "dpo_en_300.jsonl").read_text().splitlines(keepends=True)[:3]
    path = write_jsonl(tmp_path / "dpo.jsonl", [*lines, {"prompt": [], "chosen": []}])
    process = masker("dpo").process
    store = JsonlStore().load(path, processor=process)
    assert store.num_rows == 4 and store.keys == [
        "chosen",
        "chosen_mask",
        "rejected",
        "rejected_mask",
    ]
    for i, line in enumerate(lines):
        want = process(json.loads(line))
        got = store.fetch_row(i, list(want))
        assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}
    with pytest.raises(ValueError, match=f"^{path}:4: prompt: empty conversation"):
        store.fetch_row(3, "chosen")


def test_lazy_line_index_across_chunk_boundaries(tmp_path):
    """Line positions from the 4 MiB numpy scan equal a plain Python scan, blank lines skipped."""
    rng = np.random.default_rng(1)
    lines = [
        b"  \n" if i % 7 == 3 else b'{"t": "' + b"x" * int(rng.integers(0, 9000)) + b'"}\n'
        for i in range(2500)
    ]
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(lines) + b'{"t": "last line, no newline"}')
    want, pos = [], 0
    for line in [*lines, b"{}"]:
        if line.strip():
            want.append(pos)
        pos += len(line)
    store = JsonlStore().load(path, processor=lambda r: {"n": np.array([len(r["t"])])})
    assert path.stat().st_size > 2 * (1 << 22) and store._line_pos.tolist() == want
    assert store.fetch_row(store.num_rows - 1, "n").item() == len("last line, no newline")


def test_store_factory_takes_the_seed_positional_call_shape():
    store = StoreFactory.create("bin", 2048, 1024)
    assert (store.window_size, store.stride) == (2048, 1024)


def test_an_unfinished_run_is_refused_and_unlisted_shards_ignored(tmp_path):
    """A tokenmill output loads only when complete; shard folders its index does not list
    (a copied shard, a backup/ folder) are left out."""
    from tokenmill.preprocess.config import PipelineConfig
    from tokenmill.preprocess.presets import default_config
    from tokenmill.preprocess.run.pipeline import Pipeline

    src = tmp_path / "in.jsonl"
    with open(ROOT / "data" / "pretrain_c4_300.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(20)))
    out = tmp_path / "out"
    cfg = default_config("seq").model_dump(mode="json")
    cfg["output"]["max_tokens_per_shard"] = 4000
    Pipeline(
        PipelineConfig.from_dict(cfg), [src], out, ROOT / "data/tokenizers/qwen2.5", workers=1
    ).run()
    whole = MmapStore().load(out)
    shutil.copytree(out / "shard_00000_000", out / "backup" / "shard_00000_000")
    again = MmapStore().load(out)
    assert again.token_count == whole.token_count and again.num_rows == whole.num_rows
    (out / "manifest.json").rename(tmp_path / "manifest.json")  # as a killed run leaves it
    (out / ".tokenmill-run").mkdir()
    shutil.rmtree(out / "backup")
    with pytest.raises(ValueError, match="has not finished .* re-run the same preprocess command"):
        MmapStore().load(out)
    with pytest.warns(UserWarning, match="unfinished run") as said:
        assert MmapStore().load(out, allow_partial=True).token_count == whole.token_count
    assert [w.filename for w in said] == [__file__]


def test_an_edited_meta_json_is_caught_at_first_read_and_by_verify(tmp_path):
    """Issue 16's probe: a meta.json dtype edited from int32 to float32 made every token read
    as 0, and passed even verify. The manifest now covers meta.json."""
    from tokenmill.preprocess.presets import default_config
    from tokenmill.preprocess.run.pipeline import Pipeline

    src = tmp_path / "in.jsonl"
    with open(ROOT / "data" / "pretrain_c4_300.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(5)))
    out = tmp_path / "out"
    Pipeline(default_config("seq"), [src], out, ROOT / "data/tokenizers/qwen2.5", workers=1).run()
    meta_file = out / "shard_00000_000" / "meta.json"
    meta_file.write_text(meta_file.read_text().replace('"int32"', '"float32"', 1))
    problems = verify_dataset(out)
    assert problems == [
        "shard_00000_000/meta.json: edited since it was written (xxh64 differs from manifest.json)",
        "shards.index: shard_00000_000/meta.json differs from what the index recorded",
    ]
    store = MmapStore(window_size=8).load(out)  # the index opens it without reading meta.json
    with pytest.raises(ValueError, match=r"shard_00000_000"):
        store.fetch_row(0, ["sequence"])


@pytest.mark.slow
def test_a_store_of_more_shards_than_open_files_reads_every_record(tmp_path):
    """Shards are mapped on first use and at most MAX_OPEN_SHARDS stay open: 400 shards of
    4 files each read under a 256 open-file limit (mapping all would hold 1,600)."""
    with ShardWriter(tmp_path, SFT, "sequence", max_tokens_per_shard=2) as writer:
        for i in range(400):
            writer.add(
                {
                    "sequence": np.full(2, i),
                    "loss_mask": np.ones(2, bool),
                    "position_ids": np.arange(2),
                }
            )
    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "from tokenmill.training.mmap_store import MmapStore\n"
        "store = MmapStore().load(sys.argv[1])\n"
        "firsts = [int(store.fetch_row(i, 'sequence')[0]) for i in range(store.num_rows)]\n"
        "assert firsts == list(range(400)), firsts[:10]\n"
        "print(len(store._loaded()))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["400"]
