"""A dataset's index (shards.index): opening reads it alone, gives exactly what opening every
meta.json gives (items, lengths, fingerprint, sampler states), and holds no file descriptor per
shard; a dataset without one loads as before, with one warning."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DATA, QWEN, ROOT

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.index import INDEX_NAME, ShardIndex, write_index
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.sampler import RDSampler

# train type -> (records, how many, max tokens per shard): small shards, so many of them
SOURCES = {
    "seq": (DATA / "pretrain_c4_300.jsonl", 60, 2_000),
    "sft": (DATA / "chat_sharegpt_1000.jsonl", 120, 600),
    "dpo": (DATA / "dpo_en_300.jsonl", 60, 3_000),
    "kto": (ROOT / "examples" / "kto" / "records.jsonl", 1_000, 100),
    "grpo": (DATA / "grpo_from_dpo_300.jsonl", 60, 3_000),
}
CASES = [  # (train type, sft sample)
    ("seq", None),
    ("sft", "row"),
    ("sft", "record"),
    ("sft", "window"),
    ("dpo", None),
    ("kto", None),
    ("grpo", None),
]
WINDOW = 512


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each type preprocessed by the pipeline: (indexed copy, copy without index)."""
    out = {}
    for kind, (source, count, shard) in SOURCES.items():
        tmp = tmp_path_factory.mktemp(kind)
        src = tmp / "in.jsonl"
        with open(source, encoding="utf-8") as f:
            src.write_text("".join(line for _, line in zip(range(count), f, strict=False)))
        config = default_config(kind).model_dump(mode="json")
        config["output"]["max_tokens_per_shard"] = shard
        if kind in ("seq", "sft"):
            config["preprocessing"]["max_packed_len"] = WINDOW
        new = tmp / "new"
        Pipeline(PipelineConfig.from_dict(config), [src], new, QWEN, workers=1).run()
        old = tmp / "old"
        shutil.copytree(new, old)
        (old / INDEX_NAME).unlink(missing_ok=True)  # as datasets were written before
        write_index(new)
        out[kind] = (new, old)
    return out


def load(path: Path, kind: str, sample: str | None):
    return DatasetFactory.load(kind, path, window_size=WINDOW, sample=sample)


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.slow  # the pipeline, five times
@pytest.mark.parametrize("kind,sample", CASES)
def test_index_open_and_old_open_give_identical_samples_lengths_and_states(built, kind, sample):
    new, old = built[kind]
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        before = load(old, kind, sample)
    assert [str(w.message).split(":")[0] for w in said] == [str(old)]  # one warning, naming it
    assert "no shards.index" in str(said[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the indexed dataset says nothing
        after = load(new, kind, sample)
    assert ShardIndex(new / INDEX_NAME).count > 2  # several shards
    assert len(after) == len(before) > 0
    assert after.fingerprint == before.fingerprint
    for i in range(len(after)):
        assert same(after[i], before[i]), i
        assert after.sample_length(i) == before.sample_length(i), i
    indices = np.arange(len(after))
    ranges = after.item_ranges(indices)
    if ranges is not None:
        assert all(np.array_equal(x, y) for x, y in zip(ranges, before.item_ranges(indices)))
    assert np.array_equal(after.shard_bounds(), before.shard_bounds())
    for dataset in (after, before):
        assert dataset.store.num_rows == after.store.num_rows
    samplers = [RDSampler(d, seed=3, rank=0, world_size=2) for d in (after, before)]
    orders = [list(s) for s in samplers]
    assert orders[0] == orders[1]
    assert samplers[0].state_dict() == samplers[1].state_dict()


FD_PROBE = r"""
import resource, sys, os, warnings
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from tokenmill.training.dataset_factory import DatasetFactory
cases = [(p, kind, None if s == "-" else s) for p, kind, s in (a.split(",") for a in sys.argv[1:])]
datasets = [DatasetFactory.load(kind, p, window_size=512, sample=s) for p, kind, s in cases]
most = 0
for step in range(max(len(d) for d in datasets)):  # every store open at once, read in turn
    for d in datasets:
        if step < len(d):
            d[step]
            d.sample_length(step)
    most = max(most, len(os.listdir("/proc/self/fd")))
print(sum(len(d) for d in datasets), most)
"""


@pytest.mark.slow  # the pipeline, five times, and a subprocess
def test_every_dataset_type_loads_and_reads_under_an_open_file_limit_of_256(built):
    """Seven stores of 13 to 150 shards in one process, every item of each read in turn."""
    args = [f"{built[kind][0]},{kind},{sample or '-'}" for kind, sample in CASES]
    shards = [ShardIndex(built[kind][0] / INDEX_NAME).count for kind, _ in CASES]
    assert max(shards) > 79  # more shards than opened at once ever fit 256 files before
    got = subprocess.run(
        [sys.executable, "-c", FD_PROBE, *args], capture_output=True, text=True, check=False
    )
    assert got.returncode == 0, got.stderr[-2000:]
    items, most = map(int, got.stdout.split())
    expected = sum(len(load(built[kind][0], kind, sample)) for kind, sample in CASES)
    assert items == expected and most < 256


BIG_PROBE = r"""
import os, resource, sys, tracemalloc
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
import numpy as np
import torch
from tokenmill.training.dataset_factory import DatasetFactory

def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))

before = rss()
tracemalloc.start()
ds = DatasetFactory.load("seq", sys.argv[1], window_size=3, stride=4)
items = [ds[int(i)]["input_ids"].tolist() for i in np.linspace(0, len(ds) - 1, 500).astype(int)]
heap = tracemalloc.get_traced_memory()[1]
print(len(ds), heap, rss() - before, len(os.listdir("/proc/self/fd")), items[-1])
"""


@pytest.mark.slow  # writes 1e5 shard folders
def test_a_dataset_of_100k_shards_opens_in_bounded_memory_under_256_open_files(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_open import write_synthetic

    root = write_synthetic(tmp_path / "big", 100_000, tokens=8)
    write_index(root)
    got = subprocess.run(
        [sys.executable, "-c", BIG_PROBE, str(root)], capture_output=True, text=True, check=False
    )
    assert got.returncode == 0, got.stderr[-2000:]
    windows, heap, grown, fds, last = got.stdout.split(maxsplit=4)
    assert int(windows) == (100_000 * 8 - 1 - 3) // 4 + 1  # every shard's tokens, one stream
    assert int(heap) < 8 * 2**20 and int(grown) < 64 * 2**20 and int(fds) < 256
    assert json.loads(last) == [4, 5, 6]  # the last window: tokens 4..6 of the last shard


def test_the_index_records_rows_inside_documents_and_the_longest_row(tmp_path):
    """stream packing cuts documents across rows and shards; the index counts the rows that
    start inside one, as opening every row would, and sft rows are refused by it."""
    from helpers import write_sft_rows

    root = write_sft_rows(tmp_path / "rows", 2, rows=40, lengths=(2, 12), shard=30)
    write_index(root)
    index = ShardIndex(root / INDEX_NAME)
    lengths = []
    for s in range(index.count):
        offsets = np.fromfile(root / index.name(s) / "sequence.offsets.bin", dtype="<i8")
        lengths += np.diff(offsets).tolist()
    assert index.header["rows_inside"] == 0 and index.header["longest"]["sequence"] == max(lengths)
    assert index.records[-1] == 40 and index.fingerprint
    # positions that go on through every row and shard: one document, cut across them all
    base = 0
    for s in range(index.count):
        shard = root / index.name(s)
        tokens = json.loads((shard / "meta.json").read_text())["position_ids"]["shape"][0]
        (np.arange(tokens, dtype="<i4") + base).tofile(shard / "position_ids.bin")
        base += tokens
    write_index(root)
    index = ShardIndex(root / INDEX_NAME)
    assert index.header["rows_inside"] == 40 - 1  # every row but the stream's first
    with pytest.raises(ValueError, match="39 rows start inside a document"):
        DatasetFactory.load("sft", root, window_size=64)


def test_a_shard_edited_or_truncated_after_indexing_is_named_at_its_first_read(tmp_path):
    from helpers import write_sft_rows

    root = write_sft_rows(tmp_path / "rows", 3, rows=30, lengths=(2, 12), shard=30)
    write_index(root)
    meta = root / "shard_00001" / "meta.json"
    meta.write_text(meta.read_text().replace('"int32"', '"int16"', 1))
    ds = DatasetFactory.load("sft", root, window_size=64)  # O(1): nothing of shard 1 read
    ds[0]
    with pytest.raises(ValueError, match=r"shard_00001/meta.json: edited since the dataset was"):
        for i in range(len(ds)):
            ds[i]
    (root / "shards.index").write_bytes(b"TMINDEX1")
    with pytest.raises(ValueError, match="shards.index: .*rebuild it with `tokenmill index"):
        DatasetFactory.load("sft", root, window_size=64)


def test_tokenmill_index_indexes_an_old_dataset(tmp_path):
    from helpers import write_sft_rows

    root = write_sft_rows(tmp_path / "rows", 4, rows=20, lengths=(2, 12), shard=30)
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill", "index", str(root)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (root / INDEX_NAME).is_file() and ShardIndex(root / INDEX_NAME).records[-1] == 20
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "tokenmill", "index", str(empty)], capture_output=True, text=True
    )
    assert done.returncode == 2 and f"{empty}: no shard" in done.stderr
