"""`tokenmill verify` checks each shards.index against the shards of its folder: a store
opens a dataset from its index alone, so an index that no longer matches would serve the
wrong rows without a word."""

from __future__ import annotations

import json
import shutil

from helpers import write_sft_rows

from tokenmill.shards.index import INDEX_NAME, write_index
from tokenmill.shards.reader import find_shards
from tokenmill.shards.verify import verify_dataset


def indexed(tmp_path, name="rows", seed=4):
    root = write_sft_rows(tmp_path / name, seed, rows=40, lengths=(2, 12), shard=60)
    write_index(root)
    return root


def test_an_indexed_dataset_verifies_clean(tmp_path):
    root = indexed(tmp_path)
    assert len(find_shards(root)) > 3
    assert verify_dataset(root, require_manifest=False) == []


def test_a_shard_added_or_removed_after_indexing_is_named(tmp_path):
    root = indexed(tmp_path)
    shards = find_shards(root)
    shutil.copytree(shards[0], root / "shard_99999")
    shutil.rmtree(shards[1])
    assert verify_dataset(root, require_manifest=False) == [
        f"{INDEX_NAME}: lists {shards[1].name}, which is missing",
        f"{INDEX_NAME}: does not list shard_99999; rebuild it with `tokenmill index`",
    ]


def test_an_edited_meta_or_another_datasets_index_is_named(tmp_path):
    root = indexed(tmp_path)
    first = find_shards(root)[0]
    raw = (first / "meta.json").read_bytes()
    (first / "meta.json").write_text(json.dumps(json.loads(raw), indent=3))  # other bytes
    assert verify_dataset(root, require_manifest=False) == [
        f"{INDEX_NAME}: {first.name}/meta.json differs from what the index recorded"
    ]
    (first / "meta.json").write_bytes(raw)
    assert verify_dataset(root, require_manifest=False) == []
    other = indexed(tmp_path, "other", seed=5)  # shard names alike, other rows
    shutil.copy(other / INDEX_NAME, root / INDEX_NAME)
    problems = verify_dataset(root, require_manifest=False)
    assert problems and all(p.startswith(f"{INDEX_NAME}: ") for p in problems)
