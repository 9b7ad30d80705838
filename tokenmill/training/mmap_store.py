"""MmapStore: every shard of a dataset memory-mapped read-only, wherever the shards live.

Opening a dataset with an index (shards/index.py) costs O(1) shards: the index is mapped,
each shard's files are mapped on first use (at most `max_open_shards` at a time, within the
open-file limit); a dataset without one costs O(shards): every meta.json at load. The shards
are read through a source (storage/source.py): a local folder's where
they lie, a dataset at a URL (s3://...) through the machine's shard cache; the store asks it
to make ready the shards a batch of windows reads, and to fetch ahead the shards a sample
order reads next (order_prefetch.py). Pickling carries paths, never data, so DataLoader workers
map the files themselves and share the page cache.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.format import DTYPES, Column, shard_records
from tokenmill.shards.verify import INTEGRITY
from tokenmill.storage.source import BucketOptions, ShardSource, open_source
from tokenmill.training.open_views import ShardView
from tokenmill.training.store import NO_STARTS, Store, Transform


class MmapStore(Store):
    """Every shard below a folder, memory-mapped read-only; opening costs O(1) shards with
    the dataset's index, O(shards) without.

    For a URL: `cache_dir` (default TOKENMILL_CACHE or ~/.cache/tokenmill/shards) is the
    machine's shard cache, shared by every process; `cache_limit` (bytes, or "20GB") the
    most it holds, least recently used shards evicted (None: no limit); `storage_options`
    go to fsspec; `prefetch` threads download ahead of the reads in each process
    (storage.source.BucketOptions). `integrity`: what is checked of a local shard at its
    first read."""

    def __init__(
        self,
        window_size: int | None = None,
        stride: int | None = None,
        cache_dir: str | Path | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        prefetch: int = 4,
        integrity: str = "sizes",
    ):
        super().__init__(window_size, stride)
        if integrity not in INTEGRITY:
            raise ValueError(f"integrity must be one of {list(INTEGRITY)}, got {integrity!r}")
        self.integrity = integrity
        self.options = BucketOptions(cache_dir, cache_limit, storage_options, prefetch)
        self.source: ShardSource | None = None

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
        allow_partial: bool = False,
    ) -> MmapStore:
        """Maps the shards below `path`; checks every file's size against meta.json.

        A tokenmill output whose run has not finished (its run folder, no manifest) is refused
        unless `allow_partial`; shard folders the manifest does not list are ignored, with a
        warning naming them. Shards written by other tools in the seed's format (no manifest,
        no run folder) load as they are. `tokenizer_path` is accepted and unused.
        """
        if transform is not None or processor is not None:
            raise ValueError(
                "MmapStore reads tokenized shards; transform= and processor= are for JsonlStore"
            )
        self.source = open_source(path, self.options, self.integrity, allow_partial)
        self._map()
        return self

    @property
    def root(self) -> Path | str | None:
        """The dataset's folder, or its URL (None before load)."""
        return self.source.root if self.source is not None else None

    @property
    def manifest(self) -> dict | None:
        """The dataset's manifest (None without one, or before load)."""
        return self.source.manifest if self.source is not None else None

    def _source(self) -> ShardSource:
        if self.source is None:
            raise RuntimeError("Store not loaded")
        return self.source

    def _map(self) -> None:
        """A view per shard, opened by the source on first use: made when first asked for
        from the index's arrays, or all at once from every meta.json (no index)."""
        source = self._source()
        index = source.index
        if index is not None:
            files = sum(1 + bool(e["offsets"]) + bool(e["items"]) for e in index.keys.values())
            views = _IndexViews(source, index.starts, index.records, index.dtypes)
            streams = index.header.get("stream_keys")
            self._set_layout(index.starts, index.records, index.dtypes, views, files, streams)
        else:
            shards = []
            for s, (rel, meta) in enumerate(source.shards):
                sizes = {k: int(e["shape"][0]) for k, e in meta.items()}
                dtypes = {k: DTYPES[e["dtype"]] for k, e in meta.items()}
                opener = partial(source.open, s)
                shards.append(ShardView(rel, shard_records(meta), sizes, dtypes, open=opener))
            meta = source.shards[0][1]
            files = sum(
                1 + isinstance(e.get("offsets"), dict) + isinstance(e.get("items"), dict)
                for e in meta.values()
            )
            self._set_views(shards, files)
        self._view_starts = self._shared_starts

    def longest_row(self, key: str) -> int | None:
        index = self._source().index
        return None if index is None else index.header["longest"].get(self._key(key))

    def rows_inside_documents(self) -> int | None:
        index = self._source().index
        return None if index is None else index.header["rows_inside"]

    # --- reads the source prepares -------------------------------------------------------
    def _key_values(self, s: int, key: str) -> np.ndarray:
        source = self._source()
        if s in self._opened or not source.opens_keys_alone:
            return super()._key_values(s, key)
        return source.open_keys(s, [key])[key].values  # index-time scans: one key's file

    def _key_bounds(self, s: int, key: str) -> Column:
        source = self._source()
        if s in self._opened or not source.opens_keys_alone:
            return super()._key_bounds(s, key)
        return source.open_keys(s, [key], values=False)[key]  # offsets and items only

    def fetch_windows(
        self, begins: np.ndarray, length: int, keys: list[str]
    ) -> dict[str, np.ndarray]:
        source = self._source()
        if source.prefetches and len(begins):
            # every shard the batch touches, made ready at once (fetched in parallel)
            starts = self._view_starts
            b = np.asarray(begins, dtype=np.int64)
            last = len(starts) - 2
            first = np.clip(np.searchsorted(starts, b, side="right") - 1, 0, last)
            end = np.clip(
                np.searchsorted(starts, b + max(length - 1, 0), side="right") - 1, 0, last
            )
            views = {v for f, e in zip(first.tolist(), end.tolist()) for v in range(f, e + 1)}
            missing = sorted(views - set(self._opened))
            if len(missing) > 1:
                source.ready(missing)
        return super().fetch_windows(begins, length, keys)

    # --- ahead of a sample order (order_prefetch.OrderPrefetch) ---------------------------------
    def prefetch_items(
        self, first: np.ndarray, last: np.ndarray | None, share: float
    ) -> int | None:
        """Has the source fetch the shards holding items [first, last] (stream positions, or
        with `last` None record indices) in order of need, as far as `share` of its cache's
        limit goes (storage.source.ShardSource.prefetch_items). Returns the place of the first
        item not covered, or None."""
        source = self._source()
        starts = self._view_starts if last is not None else np.asarray(self._record_starts)
        top = len(starts) - 2
        ends = first if last is None else last
        a = np.clip(np.searchsorted(starts, first, side="right") - 1, 0, top)
        b = np.clip(np.searchsorted(starts, ends, side="right") - 1, 0, top)
        need: dict[int, int] = {}  # shard -> the first item that needs it
        for k, view in enumerate(np.stack([a, b], axis=1).reshape(-1).tolist()):
            need.setdefault(view, k // 2)
        return source.prefetch_items(need, self._opened, share)

    def fetch_ahead(self, first: np.ndarray, last: np.ndarray | None, share: float) -> int | None:
        """Deprecated: `prefetch_items`."""
        return self.prefetch_items(first, last, share)

    def fits_cache(self) -> bool:
        """The whole dataset fits the cache's limit: nothing is ever evicted."""
        return self.source is None or self.source.fits_cache()

    def all_cached(self) -> bool:
        """Every shard is known (in this process) to be in a cache that never evicts."""
        return self.source is not None and self.source.all_cached()

    def cache_stats(self) -> dict[str, int]:
        """A remote store's cache counts, summed over the machine's processes that used it:
        hits, downloads, download_bytes, evictions, refetched (checksum mismatches),
        remote_retries (transient errors retried), ...; {} for local shards."""
        return self.source.stats() if self.source is not None else {}

    @property
    def fingerprint(self) -> str:
        """Identity of the data: a hash over every shard's name and meta.json (sizes, checksums),
        which the dataset's index holds."""
        self._loaded()
        if self._source().index is not None:
            return self._source().index.fingerprint  # type: ignore[union-attr]
        digest = hashlib.sha256()
        for rel, meta in self._source().shards:
            digest.update(f"{rel}\n{json.dumps(meta, sort_keys=True)}\n".encode())
        return digest.hexdigest()[:16]

    def verify(self) -> list[str]:
        """Every size, checksum and offsets problem of the dataset; [] when sound. A remote
        dataset's shards are fetched into the cache, which checks every file as it comes."""
        self._loaded()
        return self._source().verify()

    def __getstate__(self) -> dict:
        """Pickles paths and metadata, never the mapped data: workers map the files themselves."""
        state = super().__getstate__()
        if state.get("_views") is not None:
            state.update(_views=None, _starts={}, _record_starts=NO_STARTS, _values={})
            state["_view_starts"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.source is not None:
            self._map()


class _IndexViews(Sequence):
    """A store's views of an indexed dataset, each made when asked for from the index's
    arrays: a store of 1e5 shards holds no object per shard."""

    def __init__(
        self,
        source: ShardSource,
        starts: dict[str, np.ndarray],
        records: np.ndarray,
        dtypes: dict[str, np.dtype],
    ) -> None:
        self.source, self.starts, self.records, self.dtypes = source, starts, records, dtypes

    def __len__(self) -> int:
        return len(self.records) - 1

    def __getitem__(self, s: int) -> ShardView:  # type: ignore[override]
        if not 0 <= s < len(self):
            raise IndexError(f"view {s} out of range [0, {len(self)})")
        sizes = {k: int(st[s + 1] - st[s]) for k, st in self.starts.items()}
        records = int(self.records[s + 1] - self.records[s])
        opener = partial(self.source.open, s)
        return ShardView(self.source.name(s), records, sizes, self.dtypes, open=opener)
