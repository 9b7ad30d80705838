"""Integrity levels at a shard's first read, and the page checksums behind integrity="sampled"."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import xxhash
from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.format import PAGE_BYTES, FileHashes
from tokenmill.shards.verify import INTEGRITY, verify_dataset
from tokenmill.shards.writer import ShardWriter
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.mmap_store import MmapStore

SFT = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
PAGES = 6  # a shard of this many 1 MiB pages of int32 tokens


def read_all(store, key="sequence"):
    return [store.fetch_row(i, key) for i in range(store.num_rows)]


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def write_sft(root):
    rng = np.random.default_rng(0)
    with ShardWriter(root, SFT, "sequence", max_tokens_per_shard=20) as writer:
        for n in (3, 7, 1, 12, 5, 9, 4, 8):
            ids = rng.integers(0, 150_000, n)
            writer.add({"sequence": ids, "loss_mask": ids % 3 > 0, "position_ids": np.arange(n)})


def write_pages(root):
    """One shard whose sequence.bin fills PAGES pages, in records of 1,024 tokens."""
    tokens = PAGES * PAGE_BYTES // 4
    with ShardWriter(root, {"sequence": "int32"}, "sequence", max_tokens_per_shard=tokens) as w:
        for start in range(0, tokens, 1024):
            w.add({"sequence": np.arange(start, start + 1024, dtype=np.int32)})
    return root / "shard_00000" / "sequence.bin"


def test_integrity_levels_find_corruption_at_a_shards_first_read(tmp_path):
    """A flipped byte passes the default size check and is found by "sampled" (a small shard
    has one page, always read) and "full" at the shard's first read; scrambled offsets are
    named by "structure"; each names the shard and the check."""
    write_sft(tmp_path)
    flipped = tmp_path / "shard_00001" / "loss_mask.bin"
    clean = flipped.read_bytes()
    flip(flipped, 0)
    read_all(MmapStore().load(tmp_path), "loss_mask")  # sizes: the flip goes unseen, as documented
    for level in ("sampled", "structure", "full"):
        with pytest.raises(
            ValueError,
            match=rf"shard_00001: corrupt, found by the integrity='{level}' check at its first "
            r"read: .*loss_mask\.bin.*(differs from its xxh64|xxh64 checksum mismatch)",
        ):
            read_all(MmapStore(integrity=level).load(tmp_path), "loss_mask")
    flipped.write_bytes(clean)
    offsets = tmp_path / "shard_00002" / "sequence.offsets.bin"
    values = np.fromfile(offsets, "<i8")
    values[[1, 2]] = values[[2, 1]]  # out of order, first and last kept
    values.tofile(offsets)
    with pytest.raises(ValueError, match=r"shard_00002: corrupt, .*'structure'.*not monotonic"):
        read_all(MmapStore(integrity="structure").load(tmp_path))
    with pytest.raises(ValueError, match=r"shard_00002: corrupt, .*'sampled'.*sequence.offsets"):
        read_all(MmapStore(integrity="sampled").load(tmp_path))
    with pytest.raises(ValueError, match="integrity must be one of"):
        MmapStore(integrity="paranoid")


def test_sampled_pages_always_read_the_first_and_last_page(tmp_path):
    path = write_pages(tmp_path)
    meta = json.loads((path.parent / "meta.json").read_text())
    assert len(meta["sequence"]["pages"]["xxh64"]) == 16 * PAGES
    read_all(MmapStore(integrity="sampled").load(tmp_path))
    for page in (0, PAGES - 1):
        clean = path.read_bytes()
        flip(path, page * PAGE_BYTES + 17)
        with pytest.raises(ValueError, match=rf"'sampled'.*sequence\.bin.*page {page} \(bytes"):
            MmapStore(integrity="sampled").load(tmp_path).fetch_row(0, "sequence")
        path.write_bytes(clean)


def test_sampled_pages_find_a_middle_page_by_chance_and_verify_names_it(tmp_path):
    """A middle page is read with probability 2/4 per open here; 40 opens miss it with
    probability 2**-40. `verify` reads every page and names the corrupt one."""
    path = write_pages(tmp_path)
    flip(path, 3 * PAGE_BYTES + 5)
    found = 0
    for _ in range(40):
        try:
            MmapStore(integrity="sampled").load(tmp_path).fetch_row(0, "sequence")
        except ValueError as err:
            assert "page 3 (bytes 3145728-4194304) differs from its xxh64" in str(err)
            found += 1
    assert 0 < found < 40
    assert verify_dataset(tmp_path, require_manifest=False) == [
        "shard_00000/sequence.bin: key 'sequence': xxh64 checksum mismatch: the data is "
        "corrupted (page 3 (bytes 3145728-4194304) differs from its xxh64)"
    ]


def test_shards_without_page_checksums_load_at_every_level(tmp_path):
    """Shards in the seed's format (no `pages` in meta.json) have nothing to sample."""
    write_sft(tmp_path)
    for meta_file in tmp_path.glob("shard_*/meta.json"):
        meta = json.loads(meta_file.read_text())
        for entry in meta.values():
            entry.pop("pages")
            entry["offsets"].pop("pages")
        meta_file.write_text(json.dumps(meta))
    reference = read_all(MmapStore().load(tmp_path))
    for level in ("sampled", "structure", "full"):
        got = read_all(MmapStore(integrity=level).load(tmp_path))
        assert all(np.array_equal(a, b) for a, b in zip(got, reference, strict=True))


@settings(max_examples=25, deadline=None)
@given(size=st.integers(0, 3 * PAGE_BYTES + 100), cuts=st.lists(st.integers(0, 4 * PAGE_BYTES)))
def test_page_hashes_match_each_page_however_the_bytes_arrive(size, cuts):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    hashes = FileHashes()
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    for a, b in zip(bounds, bounds[1:]):
        hashes.update(data[a:b])
    entry = hashes.entry()
    assert entry["xxh64"] == xxhash.xxh64(data.tobytes()).hexdigest()
    pages = [data[i : i + PAGE_BYTES].tobytes() for i in range(0, size, PAGE_BYTES)]
    assert entry["pages"] == {
        "bytes": PAGE_BYTES,
        "xxh64": "".join(xxhash.xxh64(p).hexdigest() for p in pages),
    }


def test_a_copied_dataset_keeps_its_page_checksums(tmp_path):
    """Page checksums live in meta.json, so a copy (or a download) checks the same way."""
    path = write_pages(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    flip(tmp_path / "b" / path.relative_to(tmp_path / "a"), PAGE_BYTES * PAGES - 1)
    read_all(MmapStore(integrity="sampled").load(tmp_path / "a"))
    with pytest.raises(ValueError, match=r"page 5"):
        MmapStore(integrity="sampled").load(tmp_path / "b").fetch_row(0, "sequence")


# --- the corruption scorecard: each case, and where each level finds it ---------------------
def flip_byte(out):
    flip(out / "shard_00000_001" / "chosen.bin", 101)


def zero_page(out):
    path = out / "shard_00000_001" / "chosen.bin"
    data = bytearray(path.read_bytes())
    data[4096:8192] = bytes(4096)
    path.write_bytes(bytes(data))


def scramble_offsets(out):
    path = out / "shard_00000_001" / "rejected.offsets.bin"
    values = np.fromfile(path, "<i8")
    values[[1, 2]] = values[[2, 1]]  # first and last kept: the sizes check passes
    values.tofile(path)


def shift_offsets(out):
    path = out / "shard_00000_001" / "chosen.offsets.bin"
    values = np.fromfile(path, "<i8")
    values[1:-1] += 1  # still monotonic and in range: only a checksum tells
    values.tofile(path)


def swap_shards(out):
    (out / "shard_00000_000").rename(out / "swap")
    (out / "shard_00000_001").rename(out / "shard_00000_000")
    (out / "swap").rename(out / "shard_00000_001")


def edit_dtype(out):
    meta = out / "shard_00000_001" / "meta.json"
    meta.write_text(meta.read_text().replace('"int32"', '"float32"', 1))


def truncate(out):
    path = out / "shard_00000_001" / "rejected_mask.bin"
    path.write_bytes(path.read_bytes()[:-1])


def delete(out):
    (out / "shard_00000_001" / "rejected.bin").unlink()


# case -> where each level finds it: "load" (refused by DatasetFactory.load), "read" (raised
# at the shard's first read) or None (served unseen: what the level does not promise)
SCORECARD = {
    flip_byte: (None, "read", "read", "read"),
    zero_page: (None, "read", "read", "read"),
    scramble_offsets: (None, "read", "read", "read"),
    shift_offsets: (None, "read", "read", "read"),
    # the dataset's index opens it in O(1): a shard's files and meta.json are checked when
    # the shard is first read, against what the index recorded
    swap_shards: ("read", "read", "read", "read"),
    edit_dtype: ("read", "read", "read", "read"),
    truncate: ("read", "read", "read", "read"),
    delete: ("read", "read", "read", "read"),
}


@pytest.fixture(scope="module")
def dpo_output(tmp_path_factory):
    """A DPO dataset of 2 shards, written by the pipeline from shipped data."""
    tmp = tmp_path_factory.mktemp("dpo")
    src = tmp / "in.jsonl"
    with open(ROOT / "data" / "dpo_en_300.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(40)))
    data = default_config("dpo").model_dump()
    data["output"]["max_tokens_per_shard"] = 15_000
    config = PipelineConfig.model_validate(data)
    out = tmp / "out"
    Pipeline(config, [src], out, ROOT / "data/tokenizers/qwen2.5", workers=1).run()
    assert sorted(p.name for p in out.glob("shard_*")) == ["shard_00000_000", "shard_00000_001"]
    return out


def outcome(out, level):
    try:
        dataset = DatasetFactory.load("dpo", str(out), window_size=2048, integrity=level)
    except ValueError:
        return "load"
    try:
        for i in range(len(dataset)):
            dataset[i]
    except ValueError:
        return "read"
    return None


@pytest.mark.parametrize("case", list(SCORECARD), ids=lambda case: case.__name__)
def test_each_corruption_is_found_where_its_level_promises(dpo_output, tmp_path, case):
    clean = tmp_path / "clean"
    shutil.copytree(dpo_output, clean)
    assert [outcome(clean, level) for level in INTEGRITY] == [None] * 4
    out = tmp_path / "out"
    shutil.copytree(dpo_output, out)
    case(out)
    assert tuple(outcome(out, level) for level in INTEGRITY) == SCORECARD[case]
    assert verify_dataset(out)  # verify finds every case
