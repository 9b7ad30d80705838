"""The dataset tools on a folder or a URL alike (`tokenmill verify|inspect|show DATASET`).

`verify` and `inspect` read every shard: a URL's prefix is downloaded object by object, as
it is, to a temporary folder (nothing checked on the way, so that verify finds what is
wrong) and the local tool runs on that copy, its messages naming the URL. `show` reads one
record through a store (a URL's through a temporary shard cache: one shard downloaded).
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from tokenmill.storage.location import dataset_folder


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs of --storage-option (a value read as JSON when it parses)."""
    options: dict[str, Any] = {}
    for option in pairs:
        key, sep, value = option.partition("=")
        if not sep:
            raise ValueError(f"--storage-option {option!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


def verify(dataset: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """`verify_dataset` of a folder or of a URL (on a downloaded copy, problems naming the URL):
    every object's size and checksum against its meta.json, meta.json's against the manifest."""
    from tokenmill.shards.verify import verify_dataset

    with dataset_folder(dataset, storage_options) as (root, named):
        return [named(p) for p in verify_dataset(root)]


def inspect(
    dataset: str, storage_options: dict[str, Any] | None = None, plot: str | None = None
) -> dict[str, Any]:
    """`dataset_stats` of a folder or of a URL (on a downloaded copy); with `plot`, its picture."""
    from tokenmill.tools.inspect import dataset_stats, plot_stats

    with dataset_folder(dataset, storage_options) as (root, named):
        stats = dataset_stats(root)
        stats["path"] = named(stats["path"])
        if plot:
            plot_stats(root, stats, plot)
    return stats


def record_at(
    dataset: str, index: int, storage_options: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Record `index` of a dataset of shards, a folder or a URL (one shard downloaded, to a
    temporary cache), and its manifest ({} for seed-style shards without one)."""
    from tokenmill.training.mmap_store import MmapStore  # torch: only when reading shards

    with tempfile.TemporaryDirectory(prefix="tokenmill-show-") as cache:
        store = MmapStore(cache_dir=cache, storage_options=storage_options, prefetch=0)
        store.load(dataset)
        if not 0 <= index < store.num_rows:
            raise IndexError(f"{dataset}: index {index} out of range [0, {store.num_rows})")
        record = {k: _copy(v) for k, v in store.fetch_row(index, store.keys).items()}
        return record, store.manifest or {}


def _copy(value: Any) -> Any:
    """A value of its own, not a view of a file in the temporary cache."""
    if hasattr(value, "clone"):
        return value.clone()
    return value.copy() if hasattr(value, "copy") else value
