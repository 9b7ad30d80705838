"""Choosing a dataset: `DatasetFactory` opens a path (format detected, store loaded) or wraps a
store as the dataset of a training type; `StoreOptions` is how its store is opened."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.shards.manifest import read_manifest, run_output, run_shard
from tokenmill.storage.source import through_cache
from tokenmill.training.datasets import BaseDataset, SEQDataset, SFTDataset
from tokenmill.training.factory import StoreFactory, detect_format
from tokenmill.training.record_datasets import DPODataset, GRPODataset, KTODataset

DATASETS: dict[str, type[BaseDataset]] = {
    "seq": SEQDataset,
    "sft": SFTDataset,
    "dpo": DPODataset,
    "kto": KTODataset,
    "grpo": GRPODataset,
}


@dataclass(frozen=True)
class StoreOptions:
    """How `DatasetFactory.load` opens a path's store: its windows (`window_size` tokens
    every `stride`), its format (`storage_type`; None: detected), the tokenizer of the raw
    JSONL route (`tokenizer_path`), what a shard's first read checks (`integrity`), and for a
    URL the local cache (`cache_dir`, `cache_limit`) and fsspec's `storage_options`."""

    window_size: int
    stride: int | None = None
    storage_type: str | None = None
    tokenizer_path: str | Path | None = None
    cache_dir: str | Path | None = None
    cache_limit: int | str | None = None
    storage_options: dict[str, Any] | None = None
    integrity: str = "sizes"

    def remote(self) -> dict[str, Any]:
        """The options of a dataset at a URL, as the store takes them."""
        return {
            "cache_dir": self.cache_dir,
            "cache_limit": self.cache_limit,
            "storage_options": self.storage_options,
        }


def _dataset_class(train_type: str) -> type[BaseDataset]:
    if train_type not in DATASETS:
        raise ValueError(f"unknown train_type {train_type!r}; valid: {sorted(DATASETS)}")
    return DATASETS[train_type]


class DatasetFactory:
    """Builds a dataset from a path (format detected, store loaded) or from a loaded store."""

    @staticmethod
    def create(
        train_type: str, store: Any, max_len: int = 2048, sample: str | None = None
    ) -> BaseDataset:
        """Wrap an already-loaded store; its window and stride are used as they are.
        `sample` (sft only): row (default), record or window (see SFTDataset)."""
        cls = _dataset_class(train_type)
        if sample is None:
            return cls(store, max_len=max_len)
        if cls is not SFTDataset:
            raise ValueError(f"sample= is for sft data; {train_type} items are whole records")
        return SFTDataset(store, max_len=max_len, sample=sample)

    @staticmethod
    def load(
        train_type: str,
        load_path: str | Path,
        window_size: int,
        stride: int | None = None,
        storage_type: str | None = None,
        tokenizer_path: str | Path | None = None,
        max_len: int = 2048,
        store: Any = None,
        sample: str | None = None,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        integrity: str = "sizes",
    ) -> BaseDataset:
        """Open `load_path` for `train_type`. Raw JSONL is tokenized eagerly for seq/sft and
        lazily (per fetched record) for dpo/grpo when `tokenizer_path` is given. A given
        `store` skips every path, format, tokenizer, window and stride step. `sample` (sft
        only): row (default: whole conversations, packed), record or window.

        A URL (`s3://bucket/prefix`, any fsspec filesystem) is read through a local cache
        shared by the machine's workers and ranks: `cache_dir` (default TOKENMILL_CACHE or
        ~/.cache/tokenmill/shards), `cache_limit` ("20GB", or bytes; None: no limit, else
        least recently used shards are evicted), `storage_options` for fsspec.

        `integrity` (shards): what is checked of each shard at its first read, beyond the
        file sizes checked at load, each level adding to the one before: "sizes" (nothing
        more), "sampled" (4 pages of each file against their checksums, O(1)), "structure"
        (offsets, items and document lengths, O(records)) or "full" (every checksum,
        O(bytes))."""
        _dataset_class(train_type)
        if store is None:
            options = StoreOptions(
                window_size=window_size,
                stride=stride,
                storage_type=storage_type,
                tokenizer_path=tokenizer_path,
                cache_dir=cache_dir,
                cache_limit=cache_limit,
                storage_options=storage_options,
                integrity=integrity,
            )
            store = _load_store(train_type, load_path, options)
        dataset = DatasetFactory.create(train_type, store, max_len=max_len, sample=sample)
        if tokenizer_path is not None:
            _warn_other_tokenizer(dataset, load_path, tokenizer_path)
        return dataset


def _load_store(train_type: str, load_path: str | Path, options: StoreOptions) -> Any:
    storage_type = options.storage_type
    tokenizer_path = options.tokenizer_path
    if through_cache(load_path):
        if storage_type not in (None, "bin"):
            raise ValueError(
                f"{load_path}: a dataset in object storage is read as bin shards, "
                f"not {storage_type!r}"
            )
        store = StoreFactory.create(
            "bin",
            window_size=options.window_size,
            stride=options.stride,
            integrity=options.integrity,
            **options.remote(),
        )
        return store.load(str(load_path))
    given = sorted(k for k, v in options.remote().items() if v is not None)
    if given:
        raise ValueError(f"{load_path}: {', '.join(given)} are for a dataset at a URL (s3://...)")
    if storage_type is None:
        storage_type = detect_format(load_path)
    shard_options = {"integrity": options.integrity} if storage_type == "bin" else {}
    if options.integrity != "sizes" and not shard_options:
        raise ValueError(f"{load_path}: integrity= is for bin shards, not {storage_type!r}")
    store = StoreFactory.create(
        storage_type, window_size=options.window_size, stride=options.stride, **shard_options
    )
    written = Path(load_path).is_dir() and read_manifest(Path(load_path)) is not None
    if storage_type == "jsonl" and Path(load_path).is_dir() and not written:
        _refuse_run_parts(Path(load_path))
    if storage_type != "jsonl" or written:  # shards, or JSONL the pipeline already tokenized
        store.load(load_path)
    elif train_type in ("dpo", "kto", "grpo") and tokenizer_path is not None:
        store.load(load_path, processor=record_processor(train_type, tokenizer_path))
    else:
        store.load(load_path, tokenizer_path=tokenizer_path)
    return store


def _refuse_run_parts(folder: Path) -> None:
    """A folder of JSONL parts that a preprocessing run wrote, without its manifest.json: not
    raw records to tokenize, but an incomplete or damaged dataset."""
    parts = (p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*.jsonl")))
    why = run_output(folder, next((p for p in parts if run_shard(p)), None))
    if why is not None:
        raise ValueError(
            f"{folder}: manifest.json is missing, yet a preprocessing run wrote this folder "
            f"({why}): the dataset is incomplete or damaged; restore its manifest.json or "
            "preprocess it again"
        )


def _warn_other_tokenizer(dataset: BaseDataset, load_path: Any, tokenizer_path: Any) -> None:
    """Data made with one tokenizer, loaded naming another: its ids decode to other text."""
    made = dataset.tokenizer_provenance
    if made is None:
        return
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer

    given = load_tokenizer(tokenizer_path).fingerprint
    if given != made[0]:
        warnings.warn(
            f"{load_path}: made with the tokenizer at {made[1]} (fingerprint {made[0][:12]}), "
            f"loaded with tokenizer_path={str(tokenizer_path)!r} (fingerprint {given[:12]})",
            stacklevel=3,
        )


def record_processor(train_type: str, tokenizer_path: str | Path) -> Any:
    """The lazy JSONL route: the built-in config for `train_type`, applied per record."""
    from tokenmill.preprocess.chat.tokenizer import load_tokenizer
    from tokenmill.preprocess.document.masking import RecordMasker
    from tokenmill.preprocess.presets import default_config

    masker = RecordMasker(default_config(train_type), load_tokenizer(tokenizer_path))
    return masker.process
