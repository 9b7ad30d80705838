"""MmapStore: every shard below a folder, memory-mapped read-only.

Opening costs O(shards), not O(records); pickling carries paths, never data, so DataLoader
workers map the files themselves and share the page cache. A dataset at a URL (s3://...) is
read through a machine-wide local cache (cache.py): its manifest and meta.json files at
load, each shard's files on first use (then mapped like local ones), the shards a batch of
windows needs in parallel, and more ahead in the background (prefetch.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
import weakref
from collections import OrderedDict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.shards.format import (
    DTYPES,
    FORMAT_VERSION,
    RUN_DIR,
    Column,
    checksum,
    natural_key,
    shard_records,
)
from tokenmill.shards.manifest import listed, read_manifest
from tokenmill.shards.reader import check_sizes, find_shards, map_shard, read_meta
from tokenmill.shards.verify import INTEGRITY, check_shard, verify_dataset
from tokenmill.storage.cache import ShardCache, shard_files
from tokenmill.storage.prefetch import Prefetcher
from tokenmill.storage.remote import Remote, is_url, parse_size
from tokenmill.training.store import ShardView, Store, Transform

READ_AHEAD = 2  # shards fetched after the one opened, while reads go through shards in order
_STARTING = threading.Lock()


def open_checked(shard: Path, rel: str, meta: dict, level: str) -> dict[str, Column]:
    """A shard mapped on its first read, after the store's integrity level's checks: a shard
    found corrupt raises here, naming the shard, the check and what it found."""
    problems = check_shard(shard, rel, meta, level)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(
            f"{rel}: corrupt, found by the integrity={level!r} check at its first read: "
            f"{problems[0]}{more}; run `tokenmill verify`"
        )
    return map_shard(shard, meta)


# --- shards on disk ---------------------------------------------------------------------------
class MmapStore(Store):
    """Every shard below a folder, memory-mapped read-only; opening costs O(shards), not O(records).

    For a URL: `cache_dir` (default TOKENMILL_CACHE or ~/.cache/tokenmill/shards) is the
    machine's shard cache, shared by every process; `cache_limit` (bytes, or "20GB") the
    most it holds, least recently used shards evicted (None: no limit); `storage_options`
    go to fsspec; `prefetch` threads download ahead of the reads in each process."""

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
        self.cache_dir, self.cache_limit = cache_dir, parse_size(cache_limit)
        self.storage_options, self.prefetch = storage_options, prefetch
        self.cache: ShardCache | None = None

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
        if is_url(path):
            return self._load_url(str(path))
        root = Path(path)
        self.cache = None
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder of shards")
        self.manifest = read_manifest(root)
        if self.manifest is None and (root / RUN_DIR).is_dir():
            if not allow_partial:
                raise ValueError(
                    f"{root}: the tokenmill run writing this dataset has not finished (no "
                    f"manifest.json, {RUN_DIR}/ present): re-run the same preprocess command "
                    "to finish it, or load(..., allow_partial=True) to read what is there"
                )
            warnings.warn(f"{root}: loading an unfinished run's shards", stacklevel=2)
        shards = find_shards(root)
        if not shards:
            raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
        shards = self._check_manifest(root, shards)
        self.root = root
        self._metas = [
            (str(d.relative_to(root)) if d != root else ".", read_meta(d)) for d in shards
        ]
        self._map()
        return self

    def _check_manifest(self, root: Path, shards: list[Path]) -> list[Path]:
        """The shards to read: the manifest's, all present; others ignored with a warning."""
        if not self.manifest:
            return shards
        names = {rel for rel, _ in listed(self.manifest)}
        found = {d.relative_to(root).as_posix() for d in shards}
        missing = sorted(n for n in names - found if not n.endswith(".jsonl"))
        if missing:
            raise ValueError(
                f"{root}: shards listed in manifest.json are missing: {missing[:5]}; run `tokenmill verify {root}`"
            )
        edited = [
            rel
            for rel, info in listed(self.manifest)
            if "meta_xxh64" in info
            and checksum((root / rel / "meta.json").read_bytes()) != info["meta_xxh64"]
        ]
        if edited:
            raise ValueError(
                f"{root}: meta.json of {edited[:5]} edited since written (its xxh64 differs from "
                f"manifest.json's); run `tokenmill verify {root}`"
            )
        unlisted = sorted(found - names)
        if unlisted:
            warnings.warn(
                f"{root}: ignoring shard folders manifest.json does not list: {unlisted[:5]}",
                stacklevel=3,
            )
        return [d for d in shards if d.relative_to(root).as_posix() in names]

    def _load_url(self, url: str) -> MmapStore:
        """A dataset in object storage: its manifest (required: a dataset without one is not
        complete), every shard's meta.json (checked against it); shards on first use."""
        remote = Remote(url, self.storage_options)
        try:
            manifest_bytes = remote.cat("manifest.json")
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{remote.url}/manifest.json: not found; a dataset in object storage is read "
                "only once its run has finished and uploaded its manifest"
            ) from None
        manifest = json.loads(manifest_bytes)
        if manifest.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"{remote.url}/manifest.json: format_version {manifest['format_version']} is "
                f"newer than this tokenmill reads ({FORMAT_VERSION}); upgrade tokenmill"
            )
        if manifest.get("storage_format", "bin") != "bin":
            raise ValueError(
                f"{remote.url}: storage_format {manifest['storage_format']!r}; training from "
                "object storage reads bin shards (download JSONL parts and load them locally)"
            )
        self.manifest, self.root = manifest, remote.url  # type: ignore[assignment]
        self.cache = ShardCache(remote, manifest_bytes, self.cache_dir, self.cache_limit)
        shards = sorted(listed(manifest), key=lambda e: natural_key(Path(e[0])))
        if not shards:
            raise FileNotFoundError(f"{remote.url}: manifest.json lists no shard")
        self._metas = [
            (rel, self.cache.read_meta(rel, data)) for rel, data in self.cache.metas(shards)
        ]
        self._map()
        return self

    def _map(self) -> None:
        """A view per shard, its files' sizes checked now and mapped on first use."""
        if self.cache is not None:
            self._map_remote()
            return
        views = []
        for rel, meta in self._metas:
            check_sizes(self.root / rel, meta)
            sizes = {k: int(e["shape"][0]) for k, e in meta.items()}
            dtypes = {k: DTYPES[e["dtype"]] for k, e in meta.items()}
            opener = partial(open_checked, self.root / rel, rel, meta, self.integrity)
            views.append(ShardView(rel, shard_records(meta), sizes, dtypes, open=opener))
        self._set_views(views)

    # --- a dataset in object storage ------------------------------------------------------
    def _map_remote(self) -> None:
        """Views that download their shard into the cache when first opened."""
        views = []
        for s, (rel, meta) in enumerate(self._metas):
            sizes = {k: int(e["shape"][0]) for k, e in meta.items()}
            dtypes = {k: DTYPES[e["dtype"]] for k, e in meta.items()}
            opener = partial(self._open_remote, s)
            views.append(ShardView(rel, shard_records(meta), sizes, dtypes, open=opener))
        self._set_views(views)
        self._view_starts = np.asarray(self._shared_starts, dtype=np.int64)

    def _prefetcher(self) -> Prefetcher:
        """This process's prefetch threads (a forked worker starts its own)."""
        prefetcher = self.__dict__.get("_prefetch_threads")
        if prefetcher is not None and prefetcher.pid == os.getpid():
            return prefetcher
        with _STARTING:  # threads of the training process (num_threads=N) may race here
            prefetcher = self.__dict__.get("_prefetch_threads")
            if prefetcher is None or prefetcher.pid != os.getpid():
                assert self.cache is not None
                # the threads hold the cache and the metas, not the store: they end with it
                fetch = partial(_fetch, self.cache, list(self._metas))
                prefetcher = self._prefetch_threads = Prefetcher(fetch, self.prefetch)
                weakref.finalize(self, prefetcher.close)
                self._last_opened = -2  # the first open is not yet a run in shard order
        return prefetcher

    def _open_remote(self, s: int) -> dict[str, Column]:
        """Shard s mapped from the cache, fetched first if need be (by a prefetch already
        under way, if any); starts the fill and, for reads in shard order, the read-ahead."""
        assert self.cache is not None
        prefetcher = self._prefetcher()
        if self.prefetch > 0:
            if s == self._last_opened + 1:
                prefetcher.ahead(range(s + 1, min(s + 1 + READ_AHEAD, len(self._metas))))
            self._last_opened = s
            self._start_fill(prefetcher)
        pending = prefetcher.pending(s)
        if pending is not None:
            pending.result()
        rel, meta = self._metas[s]
        return self.cache.open(rel, meta)

    # --- ahead of a sample order (order_ahead.OrderReadAhead) ---------------------------------
    def fetch_ahead(self, first: np.ndarray, last: np.ndarray | None, share: float) -> int | None:
        """Starts the downloads of the shards holding items [first, last] (stream positions, or
        with `last` None record indices) that the cache lacks, in order of need, as far as
        `share` of the cache's limit goes; until the next call they are kept from eviction and
        the shards needed after them evicted last. A shard known to be cached costs a dict
        lookup. Returns the place of the first item not covered, or None."""
        assert self.cache is not None
        cache, prefetcher = self.cache, self._prefetcher()
        cache.claim()  # a forked worker: its own look-ahead, not its parent's
        starts = self._view_starts if last is not None else np.asarray(self._record_starts)
        top = len(starts) - 2
        ends = first if last is None else last
        a, b = (
            np.clip(np.searchsorted(starts, x, side="right") - 1, 0, top) for x in (first, ends)
        )
        need: dict[int, int] = {}  # shard -> the first item that needs it
        for k, view in enumerate(np.stack([a, b], axis=1).reshape(-1).tolist()):
            need.setdefault(view, k // 2)
        budget = cache.limit * share if cache.limit is not None else None
        sizes, held, stop = self._shard_bytes(), 0, None
        keep: set[str] = set()
        for s, item in need.items():
            if s in self._opened:
                continue  # mapped: read from its pages
            if budget is not None and keep and held + sizes[s] > budget:
                stop = item
                break
            held += sizes[s]
            keep.add(self._metas[s][0])
            if cache.known(self._metas[s][0]) or prefetcher.pending(s) is not None:
                continue
            if prefetcher.busy() < 2 * prefetcher.threads:
                prefetcher.ahead([s])
                cache.counts.add(ahead=1)
        if not self.fits_cache():  # evicted last: the shards read after these, last first
            cache.keep = keep
            later = [s for s in need if need[s] >= stop] if stop is not None else []
            cache.later = {self._metas[s][0]: k for k, s in enumerate(later)}
        return stop

    def fits_cache(self) -> bool:
        """The whole dataset fits the cache's limit: nothing is ever evicted."""
        limit = self.cache.limit if self.cache is not None else None
        return limit is None or sum(self._shard_bytes()) <= limit * 0.9

    def all_cached(self) -> bool:
        """Every shard is known (in this process) to be in a cache that never evicts."""
        return (
            self.cache is not None
            and self.fits_cache()
            and len(self.cache.present) == len(self._metas)
        )

    def _shard_bytes(self) -> list[int]:
        sizes = self.__dict__.get("_sizes")
        if sizes is None:
            sizes = self._sizes = [sum(n for _, n, _ in shard_files(m)) for _, m in self._metas]
        return sizes

    def _start_fill(self, prefetcher: Prefetcher) -> None:
        """The whole dataset fetched in the background when it fits the cache limit."""
        if prefetcher.filling or self.cache is None:
            return
        if self.fits_cache():
            prefetcher.fill(list(range(len(self._metas))), self.cache.dir / "fill.lock")
        else:
            prefetcher.filling = True  # never: the cache would evict what it just fetched

    def _key_values(self, s: int, key: str) -> np.ndarray:
        if self.cache is None or s in self._opened:
            return super()._key_values(s, key)
        rel, meta = self._metas[s]  # one key's file, not the whole shard (index-time scans)
        return self.cache.open(rel, meta, [key])[key].values

    def _key_bounds(self, s: int, key: str) -> Column:
        if self.cache is None or s in self._opened:
            return super()._key_bounds(s, key)
        rel, meta = self._metas[s]  # offsets and items only
        return self.cache.open(rel, meta, [key], values=False)[key]

    def fetch_windows(
        self, begins: np.ndarray, length: int, keys: list[str]
    ) -> dict[str, np.ndarray]:
        if self.cache is not None and self.prefetch > 0 and len(begins):
            # every shard the batch touches, fetched at once and in parallel
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
                self._prefetcher().wait(missing)
        return super().fetch_windows(begins, length, keys)

    def cache_stats(self) -> dict[str, int]:
        """A remote store's cache counts, summed over the machine's processes that used it:
        hits, downloads, download_bytes, evictions, refetched (checksum mismatches),
        remote_retries (transient errors retried), ...; {} for local shards."""
        return self.cache.stats() if self.cache is not None else {}

    @property
    def fingerprint(self) -> str:
        """Identity of the data: a hash over every shard's name and meta.json (sizes, checksums)."""
        self._loaded()
        digest = hashlib.sha256()
        for rel, meta in self._metas:
            digest.update(f"{rel}\n{json.dumps(meta, sort_keys=True)}\n".encode())
        return digest.hexdigest()[:16]

    def verify(self) -> list[str]:
        """Every size, checksum and offsets problem of the dataset; [] when sound. A remote
        dataset's shards are fetched into the cache, which checks every file as it comes."""
        self._loaded()
        if self.cache is not None:
            problems = []
            for rel, meta in self._metas:
                try:
                    self.cache.open(rel, meta)
                except ValueError as err:
                    problems.append(str(err))
            return problems
        return verify_dataset(self.root, require_manifest=self.manifest is not None)

    def __getstate__(self) -> dict:
        """Pickles paths and metadata, never the mapped data: workers map the files themselves."""
        state = super().__getstate__()
        state.pop("_prefetch_threads", None)
        if state.get("_views") is not None:
            state.update(_views=None, _starts=None, _record_starts=[], _values={})
            state["_opened"] = OrderedDict()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if getattr(self, "_metas", None) is not None:
            self._map()


def _fetch(cache: ShardCache, metas: list[tuple[str, dict]], s: int, wait: bool) -> bool:
    """A prefetch thread's work: shard s's files into the cache (`wait`: even if another
    process holds it)."""
    rel, meta = metas[s]
    return cache.ensure(rel, meta, wait=wait)
