"""A shard's files in the local cache: which files a shard's keys need, its lock file, the
(size, mtime, inode) stamps kept when each was checked (`.checked`), a file's check against
its meta.json, some keys of a shard mapped, and the cache's counts (per process, on disk)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from tokenmill.shards.files import file_checksum
from tokenmill.shards.format import DTYPES, OFFSET_DTYPE, Column, checksum
from tokenmill.shards.reader import map_array, map_bounds

CHECKED = ".checked"


def shard_files(meta: dict, keys: list[str] | None = None, values: bool = True) -> list[tuple]:
    """(file name, bytes, xxh64 or None) of the files `keys` of a shard need: each key's
    `.bin` (unless `values` is False: offsets and items only) and its bounds files."""
    files = []
    for key in keys if keys is not None else list(meta):
        entry = meta[key]
        if values:
            size = entry["shape"][0] * DTYPES[entry["dtype"]].itemsize
            files.append((f"{key}.bin", size, entry.get("xxh64")))
        for part in ("offsets", "items"):
            bounds = entry.get(part)
            if isinstance(bounds, dict):
                size = bounds["count"] * OFFSET_DTYPE.itemsize
                files.append((bounds["file"], size, bounds.get("xxh64")))
    return files


def shard_rows(meta: dict) -> int:
    """A shard's rows (records): its first key's offsets, or values where it has none."""
    entry = next(iter(meta.values()))
    bounds = entry.get("offsets")
    if isinstance(bounds, dict):
        return int(bounds["count"]) - 1
    if isinstance(bounds, list):
        return len(bounds) - 1
    return int(entry["shape"][0])


def lock_file(dataset: Path, rel: str) -> Path:
    """The file whose lock (`shards.files.locked`) guards shard `rel` of a cached dataset:
    readers hold it shared, a download and an eviction exclusive."""
    return dataset / "locks" / (rel.replace("/", "__") + ".lock")


class CacheStats:
    """This process's counts, also kept on disk (`stats/<host>-<pid>.json`) so that one
    process can read what all of the machine's did (`ShardCache.stats()`)."""

    NAMES = ("hits", "downloads", "download_bytes", "evictions", "refetched", "rechecked", "ahead")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                self.counts[name] += n


def meta_ok(data: bytes, info: dict) -> bool:
    return "meta_xxh64" not in info or checksum(data) == info["meta_xxh64"]


def matches(path: Path, size: int, digest: str | None) -> bool:
    try:
        if path.stat().st_size != size:
            return False
    except FileNotFoundError:
        return False
    return digest is None or file_checksum(path) == digest


def read_checked(shard: Path) -> dict[str, list[int]]:
    try:
        return json.loads((shard / CHECKED).read_text())
    except (OSError, ValueError):
        return {}


def write_checked(shard: Path, checked: dict) -> None:
    tmp = shard / f"{CHECKED}.{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    tmp.write_text(json.dumps(checked))
    os.replace(tmp, shard / CHECKED)


def map_keys(shard: Path, meta: dict, keys: list[str], values: bool) -> dict[str, Column]:
    """Some keys of a shard mapped; without values, a key's values are an empty array and
    only its offsets and items are read (a dataset's lengths at load)."""
    columns = {}
    for key in keys:
        entry = meta[key]
        count = entry["shape"][0]
        vals = (
            map_array(shard / f"{key}.bin", entry["dtype"], count, key)
            if values
            else np.empty(0, DTYPES[entry["dtype"]])
        )
        items = map_bounds(shard, key, entry.get("items"), count)
        below = count if items is None else len(items) - 1
        columns[key] = Column(vals, map_bounds(shard, key, entry.get("offsets"), below), items)
    return columns
