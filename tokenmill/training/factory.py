"""Choosing a store: `detect_format` for a path, `StoreFactory.create` for a format name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenmill.shards.format import is_tmp
from tokenmill.shards.index import INDEX_NAME
from tokenmill.storage.source import through_cache
from tokenmill.training.jsonl_store import JsonlStore
from tokenmill.training.mmap_store import MmapStore
from tokenmill.training.store import Store


def detect_format(path: str | Path) -> str:
    """'bin' for a folder of shards, 'jsonl' for a .jsonl file or a folder of them; a URL is
    'bin' (object storage holds shard datasets, read through MmapStore's cache)."""
    if through_cache(path):
        return "bin"
    path = Path(path)
    if path.is_file():
        if path.suffix == ".jsonl":
            return "jsonl"
        raise ValueError(
            f"{path}: cannot load a {path.suffix or 'suffix-less'} file; give a .jsonl file or a folder"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")

    if (path / INDEX_NAME).is_file():  # an indexed dataset of shards: no folder listed
        return "bin"

    def any_below(pattern: str) -> bool:
        return any(not is_tmp(p.relative_to(path)) for p in path.rglob(pattern))

    if any_below("*.bin") and any_below("meta.json"):
        return "bin"
    if any_below("*.jsonl"):
        return "jsonl"
    raise FileNotFoundError(f"{path}: no shards (*.bin + meta.json) and no *.jsonl files below it")


# --- choosing a store by name ------------------------------------------------------------------
STORE_OPTIONS = ("window_size", "stride")
SHARD_OPTIONS = ("integrity",)  # MmapStore's: what it checks of a shard at first read
REMOTE_OPTIONS = ("cache_dir", "cache_limit", "storage_options", "prefetch")  # for URLs


STORES: dict[str, type[Store]] = {"bin": MmapStore, "jsonl": JsonlStore}


class StoreFactory:
    """Picks the store class for a storage format name ('bin' or 'jsonl')."""

    @staticmethod
    def create(
        storage_type: str, window_size: int | None = None, stride: int | None = None, **options: Any
    ) -> Store:
        classes = STORES
        if storage_type not in classes:
            raise ValueError(f"unknown storage type {storage_type!r}; valid: {sorted(classes)}")
        valid = STORE_OPTIONS + (SHARD_OPTIONS + REMOTE_OPTIONS if storage_type == "bin" else ())
        unknown = sorted(set(options) - set(valid))
        if unknown:
            more = (
                f" (and {list(SHARD_OPTIONS)}; for a dataset at a URL: {list(REMOTE_OPTIONS)})"
                if storage_type == "bin"
                else ""
            )
            raise TypeError(
                f"StoreFactory.create: unknown keyword(s) {unknown}; valid: {list(STORE_OPTIONS)}{more}"
            )
        return classes[storage_type](window_size=window_size, stride=stride, **options)
