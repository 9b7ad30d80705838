"""Shard sources: where a dataset's shards live, as the store that reads them sees it.

A store reads every shard through one `ShardSource`: the dataset's manifest (or None), each
shard's name and meta.json in order, a shard's columns opened (all keys, or one key alone
where that costs less), a group of shards made ready before a batch of windows reads them,
the shards of a sample order fetched ahead within a share of the cache, whether the whole
dataset is at hand, counts, and a full verification. Two sources: a local folder
(`FolderSource`: every shard mapped where it lies, checked at the store's integrity level),
and a bucket read through the machine's shard cache (`bucket_source.BucketSource`: the
client, the cache, its eviction, the prefetch threads and the look-ahead budget).
`open_source` picks one: with the object storage client and `location`, the one place that
tells a URL from a local path. Pickled, a source carries paths and metadata, never data or
threads: a DataLoader worker opens its own.

A dataset with an index (shards/index.py) opens in O(1) shards: names and counts come from
the index, a shard's meta.json is read only when the shard is opened and its checksums are
needed (an integrity level above "sizes", or a download). A dataset without one reads every
meta.json at load, as before the index, and says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.shards.format import RUN_DIR, Column, checksum
from tokenmill.shards.index import INDEX_NAME, ShardIndex, find_index
from tokenmill.shards.manifest import (
    domain_of_finished,
    listed,
    read_manifest,
    refuse_split_root,
    run_output,
    run_shard,
)
from tokenmill.shards.reader import check_sizes, find_shards, map_shard, read_meta
from tokenmill.shards.verify import check_shard, verify_dataset
from tokenmill.storage.remote import is_url, parse_size


@dataclass
class BucketOptions:
    """How a dataset in a bucket is read: `cache_dir` is the machine's shard cache, shared by
    every process (default TOKENMILL_CACHE or ~/.cache/tokenmill/shards); `cache_limit` the
    most it holds (bytes, or "20GB"; None: no limit), least recently used shards evicted;
    `storage_options` go to fsspec; `prefetch` threads download ahead of the reads in each
    process (0: none). A local folder needs none of them."""

    cache_dir: str | Path | None = None
    cache_limit: int | str | None = None
    storage_options: dict[str, Any] | None = None
    prefetch: int = 4
    limit: int | None = field(init=False)  # cache_limit in bytes

    def __post_init__(self) -> None:
        self.limit = parse_size(self.cache_limit)  # a size that does not parse fails here


class IndexedShards(Sequence):
    """A dataset's shards as its index lists them: (name, meta.json) by number, each meta.json
    read (`read`) only when asked for."""

    def __init__(self, index: ShardIndex, read: Callable[[int], dict]) -> None:
        self.shard_index, self.read = index, read

    def __len__(self) -> int:
        return self.shard_index.count

    def __getitem__(self, s: int) -> tuple[str, dict]:  # type: ignore[override]
        if not 0 <= s < self.shard_index.count:
            raise IndexError(f"shard {s} out of range [0, {self.shard_index.count})")
        return self.shard_index.name(s), self.read(s)

    def __iter__(self) -> Iterator[tuple[str, dict]]:
        return (self[s] for s in range(len(self)))


class ShardSource:
    """Where a dataset's shards live (see the module docstring). `shards` lists each shard's
    name below the dataset and its meta.json, in the order the store reads them (read on
    demand where the dataset has an `index`)."""

    root: Path | str  # the dataset's folder, or its URL
    shards: Sequence[tuple[str, dict]]
    index: ShardIndex | None = None
    opens_keys_alone = False  # one key of a shard opens for less than the whole shard
    prefetches = False  # downloads ahead of the reads: `ready` and `prefetch_items` do something

    @property
    def manifest(self) -> dict | None:
        """The dataset's manifest, read when first asked for (None without one)."""
        raise NotImplementedError

    def name(self, s: int) -> str:
        """Shard s's name below the dataset."""
        return self.index.name(s) if self.index is not None else self.shards[s][0]

    def open(self, s: int) -> dict[str, Column]:
        """Shard s's columns, mapped read-only."""
        raise NotImplementedError

    def open_keys(self, s: int, keys: list[str], values: bool = True) -> dict[str, Column]:
        """Some keys of shard s (without `values`: their offsets and items; the values may
        then be empty)."""
        columns = self.open(s)
        return {k: columns[k] for k in keys}

    def ready(self, shards: list[int]) -> None:
        """These shards made ready to open at once, before a batch reads them all."""

    def prefetch_items(
        self, need: dict[int, int], opened: Container[int], share: float
    ) -> int | None:
        """Starts fetching the shards a sample order reads next (`need`: shard -> the first
        item that reads it, in order), those `opened` aside, as far as `share` of the cache's
        limit goes. Returns the first item not covered, or None."""
        return None

    def fits_cache(self) -> bool:
        """The whole dataset fits where it is read from: nothing is ever evicted."""
        return True

    def all_cached(self) -> bool:
        """Every shard is known (in this process) to be in a cache that never evicts."""
        return False

    def stats(self) -> dict[str, int]:
        """The cache's counts, summed over the machine's processes; {} without one."""
        return {}

    def verify(self) -> list[str]:
        """Every size, checksum and offsets problem of the dataset; [] when sound."""
        raise NotImplementedError


def through_cache(path: str | Path) -> bool:
    """Whether a dataset at `path` is read through the machine's shard cache: it lies in
    object storage (a URL), which holds datasets of bin shards, and BucketOptions apply."""
    return is_url(path)


def holds_shards(path: str | Path) -> bool:
    """Whether `path` names a dataset of shards: a URL (object storage holds those only), or
    a folder with a shard (a meta.json) below it."""
    if through_cache(path):
        return True
    folder = Path(path)
    return folder.is_dir() and any(folder.rglob("meta.json"))


def open_source(
    path: str | Path,
    options: BucketOptions | None = None,
    integrity: str = "sizes",
    allow_partial: bool = False,
) -> ShardSource:
    """The shards of the dataset at `path`: a URL's through the machine's cache (`options`),
    a local folder's where they lie, each checked at `integrity` when first opened. A local
    tokenmill output whose run has not finished is refused unless `allow_partial`."""
    if through_cache(path):
        from tokenmill.storage.bucket_source import BucketSource  # the client, on demand

        return BucketSource(str(path), options or BucketOptions())
    return FolderSource.load(Path(path), integrity, allow_partial)


def open_checked(shard: Path, rel: str, meta: dict, level: str) -> dict[str, Column]:
    """A shard mapped on its first read, after the store's integrity level's checks: a shard
    found corrupt raises here, naming the shard, the check and what it found."""
    check_sizes(shard, meta)  # a missing or truncated file is named before any is read
    problems = check_shard(shard, rel, meta, level)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(
            f"{rel}: corrupt, found by the integrity={level!r} check at its first read: "
            f"{problems[0]}{more}; run `tokenmill verify`"
        )
    return map_shard(shard, meta)


class FolderSource(ShardSource):
    """Every shard below a local folder, mapped where it lies, checked at the integrity level
    when first opened. With an index, nothing more is read at load; without, every meta.json
    is read and every file's size checked when the source is made (and again in each process
    it is sent to)."""

    root: Path

    def __init__(
        self,
        root: Path,
        manifest: dict | None,
        shards: list[tuple[str, dict]] | None,
        integrity: str,
        index: ShardIndex | None = None,
    ):
        self.root, self._manifest, self.integrity, self.index = root, manifest, integrity, index
        if index is not None:
            self.shards: Sequence[tuple[str, dict]] = IndexedShards(index, self._read_meta)
        else:
            self.shards = shards or []
            self._check_sizes()

    @property
    def manifest(self) -> dict | None:
        if self._manifest is None and (self.root / "manifest.json").is_file():
            self._manifest = read_manifest(self.root)
        return self._manifest

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_manifest": None}  # read again where asked for

    def _read_meta(self, s: int) -> dict:
        """Shard s's meta.json, checked against the index (where it was edited since)."""
        assert self.index is not None
        rel = self.index.name(s)
        path = self.root / rel / "meta.json"
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(
                f"{path}: cannot read: {err}; the dataset changed since it was indexed, run "
                f"`tokenmill verify {self.root}`"
            ) from None
        self.index.check_meta(s, data, str(path))
        return read_meta(self.root / rel)

    @classmethod
    def load(cls, root: Path, integrity: str, allow_partial: bool) -> FolderSource:
        """The shards below `root`: the manifest's, or every shard folder without one. A
        folder without manifest.json that a preprocessing run wrote (`run_output`) is refused
        unless `allow_partial`: its run did not finish, or its manifest was lost."""
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder of shards")
        finished = (root / "manifest.json").is_file() or domain_of_finished(root)
        if (root / "manifest.json").is_file():
            refuse_split_root(root, read_manifest(root))
        index = find_index(root)
        why = None
        if not finished:
            first = index.name(0) if index is not None and index.count else None
            why = run_output(root, first)
            _refuse_unfinished(root, why, allow_partial)
        if index is not None:  # O(1): a listed shard gone is named at its first read
            return cls(root, None, None, integrity, index)
        warnings.warn(
            f"{root}: no {INDEX_NAME} (written before datasets had one): opening reads every "
            f"shard's meta.json; run `tokenmill index {root}` once to open it in O(1)",
            stacklevel=4,
        )
        manifest = read_manifest(root)
        folders = find_shards(root)
        if not folders:
            raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
        if not finished and why is None:  # a run's shards, by their names
            named = next((d for d in folders if run_shard(d.name)), None)
            if named is not None:
                rel = named.relative_to(root).as_posix()
                _refuse_unfinished(root, run_output(root, rel), allow_partial)
        folders = _manifest_shards(root, manifest, folders)
        shards = [(str(d.relative_to(root)) if d != root else ".", read_meta(d)) for d in folders]
        return cls(root, manifest, shards, integrity)

    def _check_sizes(self) -> None:
        for rel, meta in self.shards:
            check_sizes(self.root / rel, meta)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.index is None:
            self._check_sizes()

    def open(self, s: int) -> dict[str, Column]:
        rel, meta = self.shards[s]
        return open_checked(self.root / rel, rel, meta, self.integrity)

    def verify(self) -> list[str]:
        return verify_dataset(self.root, require_manifest=self.manifest is not None)


def _refuse_unfinished(root: Path, why: str | None, allow_partial: bool) -> None:
    """A folder without manifest.json that a preprocessing run wrote (`why` says how it shows
    it; None: not a run's) is refused, unless `allow_partial` (then loaded, with a warning)."""
    if why is None:
        return
    if not allow_partial:
        if (root / RUN_DIR).is_dir():
            raise ValueError(
                f"{root}: the tokenmill run writing this dataset has not finished (no "
                f"manifest.json, {RUN_DIR}/ present): re-run the same preprocess command "
                "to finish it, or load(..., allow_partial=True) to read what is there"
            )
        raise ValueError(
            f"{root}: manifest.json is missing, yet a preprocessing run wrote this folder "
            f"({why}): the dataset is incomplete or damaged; restore its manifest.json, "
            "preprocess it again, or load(..., allow_partial=True) to read the shards there"
        )
    warnings.warn(
        f"{root}: loading an unfinished run's shards", stacklevel=5
    )  # the caller of the store's load


def _manifest_shards(root: Path, manifest: dict | None, shards: list[Path]) -> list[Path]:
    """The shards to read: the manifest's, all present; others ignored with a warning."""
    if not manifest:
        return shards
    names = {rel for rel, _ in listed(manifest)}
    found = {d.relative_to(root).as_posix() for d in shards}
    missing = sorted(n for n in names - found if not n.endswith(".jsonl"))
    if missing:
        raise ValueError(
            f"{root}: shards listed in manifest.json are missing: {missing[:5]}; "
            f"run `tokenmill verify {root}`"
        )
    edited = [
        rel
        for rel, info in listed(manifest)
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
            stacklevel=5,  # the caller of the store's load
        )
    return [d for d in shards if d.relative_to(root).as_posix() in names]
