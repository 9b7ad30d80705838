"""The bucket source: a dataset in object storage, read through the machine's shard cache.

Its manifest (required: a dataset without one is not complete) and its index (one GET per
machine, kept in the cache folder) are read when the source is made; a shard's meta.json is
fetched with the shard, checked against the index (a dataset without an index has every
meta.json read at load, each checked against the manifest, and says so once); a shard's files are
fetched into the machine-wide cache (cache.py) on first use and mapped from there like local
ones. Ahead of the reads (prefetch.py): every shard a batch of windows touches, in parallel
(`ready`); the next shards while reads go through them in order; the whole dataset when it
fits the cache's limit; and the shards a sample order reads next, within a share of that
limit, kept from eviction until the next look (`prefetch_items`).
"""

from __future__ import annotations

import os
import threading
import uuid
import warnings
import weakref
from collections.abc import Container, Sequence
from functools import partial
from pathlib import Path

from tokenmill.shards.files import locked
from tokenmill.shards.format import Column, natural_key
from tokenmill.shards.index import INDEX_NAME, ShardIndex
from tokenmill.shards.manifest import listed, parse_manifest, refuse_split_root
from tokenmill.storage.cache import ShardCache, shard_files
from tokenmill.storage.cache_files import lock_file
from tokenmill.storage.prefetch import Prefetcher
from tokenmill.storage.remote import STATS, NoSuchBucket, Remote
from tokenmill.storage.source import BucketOptions, IndexedShards, ShardSource

READ_AHEAD = 2  # shards fetched after the one opened, while reads go through shards in order
_STARTING = threading.Lock()


class BucketSource(ShardSource):
    """A dataset at a URL, its shards in the machine's cache (see the module docstring)."""

    opens_keys_alone = True  # one key's file, not the whole shard (a dataset's index at load)

    def __init__(self, url: str, options: BucketOptions):
        remote = Remote(url, options.storage_options)
        try:
            manifest_bytes = remote.cat("manifest.json")
        except NoSuchBucket:
            raise
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{remote.url}/manifest.json: not found; a dataset in object storage is read "
                "only once its run has finished and uploaded its manifest"
            ) from None
        refuse_split_root(remote.url, parse_manifest(manifest_bytes, remote.where("manifest.json")))
        self.root, self.options = remote.url, options
        self.prefetches = options.prefetch > 0
        self.cache = ShardCache(remote, manifest_bytes, options.cache_dir, options.limit)
        self._manifest: dict | None = None
        self.index = _cached_index(self.cache)
        self._last_opened = -2  # the shard opened last, for the read-ahead of shards in order
        if self.index is not None:
            self.shards: Sequence[tuple[str, dict]] = IndexedShards(
                self.index, _MetaReader(self.cache, self.index)
            )
            return
        manifest = self.manifest
        assert manifest is not None
        if manifest.get("storage_format", "bin") != "bin":
            raise ValueError(
                f"{remote.url}: storage_format {manifest['storage_format']!r}; training from "
                "object storage reads bin shards (download JSONL parts and load them locally)"
            )
        warnings.warn(
            f"{remote.url}: no {INDEX_NAME} (written before datasets had one): opening fetches "
            f"every shard's meta.json; index a local copy (`tokenmill index`) and upload its "
            f"{INDEX_NAME} to open it in O(1)",
            stacklevel=5,  # the caller of the store's load
        )
        shards = sorted(listed(manifest), key=lambda e: natural_key(Path(e[0])))
        if not shards:
            raise FileNotFoundError(f"{remote.url}: manifest.json lists no shard")
        self.shards = [
            (rel, self.cache.read_meta(rel, data)) for rel, data in self.cache.metas(shards)
        ]

    @property
    def manifest(self) -> dict | None:
        if self._manifest is None:
            where = f"{self.root}/manifest.json"
            self._manifest = parse_manifest(self.cache.manifest_bytes, where)
        return self._manifest

    def __getstate__(self) -> dict:
        """Paths and metadata: a worker starts its own prefetch threads."""
        state = dict(self.__dict__)
        state.pop("_prefetch_threads", None)
        state["_manifest"] = None  # parsed again where asked for
        return state

    def _prefetcher(self) -> Prefetcher:
        """This process's prefetch threads (a forked worker starts its own)."""
        prefetcher = self.__dict__.get("_prefetch_threads")
        if prefetcher is not None and prefetcher.pid == os.getpid():
            return prefetcher
        with _STARTING:  # threads of the training process (num_threads=N) may race here
            prefetcher = self.__dict__.get("_prefetch_threads")
            if prefetcher is None or prefetcher.pid != os.getpid():
                # the threads hold the cache and the metas, not the source: they end with it
                fetch = partial(_fetch, self.cache, self.shards)
                prefetcher = self._prefetch_threads = Prefetcher(fetch, self.options.prefetch)
                weakref.finalize(self, prefetcher.close)
                self._last_opened = -2  # the first open is not yet a run in shard order
        return prefetcher

    def open(self, s: int) -> dict[str, Column]:
        """Shard s mapped from the cache, fetched first if need be (by a prefetch already
        under way, if any); starts the fill and, for reads in shard order, the read-ahead."""
        prefetcher = self._prefetcher()
        if self.prefetches:
            if s == self._last_opened + 1:
                prefetcher.ahead(range(s + 1, min(s + 1 + READ_AHEAD, len(self.shards))))
            self._last_opened = s
            self._start_fill(prefetcher)
        pending = prefetcher.pending(s)
        if pending is not None:
            pending.result()
        rel, meta = self.shards[s]
        return self.cache.open(rel, meta)

    def open_keys(self, s: int, keys: list[str], values: bool = True) -> dict[str, Column]:
        rel, meta = self.shards[s]
        return self.cache.open(rel, meta, keys, values=values)

    def ready(self, shards: list[int]) -> None:
        """Fetched at once and in parallel, waited for: every shard of a batch."""
        self._prefetcher().wait(shards)

    def prefetch_items(
        self, need: dict[int, int], opened: Container[int], share: float
    ) -> int | None:
        """Starts the downloads of the needed shards that the cache lacks, in order of need,
        as far as `share` of the cache's limit goes; until the next call they are kept from
        eviction and the shards needed after them evicted last. A shard known to be cached
        costs a dict lookup."""
        cache, prefetcher = self.cache, self._prefetcher()
        cache.claim()  # a forked worker: its own look-ahead, not its parent's
        budget = cache.lookahead_budget(share)  # its part of the machine's look-ahead
        sizes = self._shard_bytes()
        held = 0
        stop = None
        keep: set[str] = set()
        for s, item in need.items():
            if s in opened:
                continue  # mapped: read from its pages
            if budget is not None and keep and held + sizes[s] > budget:
                stop = item
                break
            held += sizes[s]
            name = self.name(s)
            keep.add(name)
            if cache.known(name) or prefetcher.pending(s) is not None:
                continue
            if prefetcher.busy() < 2 * prefetcher.threads:
                prefetcher.ahead([s])
                cache.counts.add(ahead=1)
        if not self.fits_cache():  # evicted last: the shards read after these, last first
            cache.keep = keep
            later = [s for s in need if need[s] >= stop] if stop is not None else []
            cache.later = {self.name(s): k for k, s in enumerate(later)}
        return stop

    def fits_cache(self) -> bool:
        """The whole dataset fits the cache's limit: nothing is ever evicted."""
        limit = self.cache.limit
        return limit is None or sum(self._shard_bytes()) <= limit * 0.9

    def all_cached(self) -> bool:
        return self.fits_cache() and len(self.cache.present) == len(self.shards)

    def _shard_bytes(self) -> list[int]:
        sizes = self.__dict__.get("_sizes")
        if sizes is None and self.index is not None:
            sizes = self._sizes = self.index.shard_bytes().tolist()
        elif sizes is None:
            sizes = self._sizes = [sum(n for _, n, _ in shard_files(m)) for _, m in self.shards]
        return sizes

    def _start_fill(self, prefetcher: Prefetcher) -> None:
        """The whole dataset fetched in the background when it fits the cache limit."""
        if prefetcher.filling:
            return
        if self.fits_cache():
            prefetcher.fill(list(range(len(self.shards))), self.cache.dir / "fill.lock")
        else:
            prefetcher.filling = True  # never: the cache would evict what it just fetched

    def stats(self) -> dict[str, int]:
        """Hits, downloads, download_bytes, evictions, refetched (checksum mismatches),
        remote_retries (transient errors retried), ..., summed over the machine's processes
        that used the cache."""
        return self.cache.stats()

    def verify(self) -> list[str]:
        """Every shard fetched into the cache, which checks every file as it comes."""
        problems = []
        for rel, meta in self.shards:
            try:
                self.cache.open(rel, meta)
            except ValueError as err:
                problems.append(str(err))
        return problems


def _cached_index(cache: ShardCache) -> ShardIndex | None:
    """The dataset's index from the machine's cache folder, fetched there first (one GET per
    machine, under a lock); None where the dataset has none."""
    path = cache.dir / INDEX_NAME
    if not path.is_file():
        with locked(lock_file(cache.dir, INDEX_NAME)):
            if not path.is_file():
                try:
                    data = cache.remote.cat(INDEX_NAME)
                except FileNotFoundError:
                    return None
                _write_aside(path, data)
    return ShardIndex(path)


def _write_aside(path: Path, data: bytes) -> None:
    """`data` at `path`, written aside and renamed: readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class _MetaReader:
    """Shard s's meta.json: from the cache folder, else fetched into it; checked against the
    index (a mismatch is fetched once more, then refused). The prefetch threads hold this, not
    the source."""

    def __init__(self, cache: ShardCache, index: ShardIndex) -> None:
        self.cache, self.index = cache, index

    def __call__(self, s: int) -> dict:
        rel = self.index.name(s)
        path = self.cache.dir / "meta" / rel / "meta.json"
        where = f"{self.cache.remote.where(rel)}/meta.json"
        data = self.cache.meta_bytes(rel, partial(self._ok, s))  # once per machine
        if data is None:
            data = self.cache.remote.cat(f"{rel}/meta.json")  # once more, then refuse
            STATS.add(refetches=1)
            self.index.check_meta(s, data, where)
            _write_aside(path, data)
        return self.cache.read_meta(rel, data)

    def _ok(self, s: int, data: bytes) -> bool:
        try:
            self.index.check_meta(s, data, "")
        except ValueError:
            return False
        return True


def _fetch(cache: ShardCache, shards: Sequence[tuple[str, dict]], s: int, wait: bool) -> bool:
    """A prefetch thread's work: shard s's files into the cache (`wait`: even if another
    process holds it)."""
    rel, meta = shards[s]
    return cache.ensure(rel, meta, wait=wait)
