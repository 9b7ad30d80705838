"""Stores: a dataset folder of shards, or raw JSONL, -> tensors by window or by record.

Sits between shards.py (the on-disk format) and datasets.py. `fetch(begin, end, keys)`
reads a key's stream across shard boundaries; `fetch_record(i, keys)` reads record i by
offsets. MmapStore maps files read-only, so DataLoader workers share the page cache;
JsonlStore keeps transformed records in the same layout, or processes them lazily.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.shards import (
    DTYPES,
    OFFSET_DTYPE,
    Column,
    find_shards,
    is_tmp,
    primary_key,
    read_manifest,
    read_meta,
    shard_records,
)
from tokenmill.verify import verify_dataset

Transform = Callable[[dict], dict]


def window_count(token_count: int, window_size: int, stride: int) -> int:
    """Windows [i*stride, i*stride + window_size) that leave one more token for the shifted target."""
    if token_count <= window_size:
        return 0
    return (token_count - 1 - window_size) // stride + 1


def window_bounds(i: int, window_size: int, stride: int) -> tuple[int, int]:
    return i * stride, i * stride + window_size


def detect_format(path: str | Path) -> str:
    """'bin' for a folder of shards, 'jsonl' for a .jsonl file or a folder of them."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".jsonl":
            return "jsonl"
        raise ValueError(
            f"{path}: cannot load a {path.suffix or 'suffix-less'} file; give a .jsonl file or a folder"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")

    def any_below(pattern: str) -> bool:
        return any(not is_tmp(p.relative_to(path)) for p in path.rglob(pattern))

    if any_below("*.bin") and any_below("meta.json"):
        return "bin"
    if any_below("*.jsonl"):
        return "jsonl"
    raise FileNotFoundError(f"{path}: no shards (*.bin + meta.json) and no *.jsonl files below it")


def to_tensor(values: Any) -> torch.Tensor:
    """A writable copy of just these values (memmap slices are read-only)."""
    return torch.from_numpy(np.array(values))


@dataclass
class Segment:
    """One shard (or one in-memory JSONL load): its columns and record count."""

    name: str
    columns: dict[str, Column]
    records: int


class Store:
    """Stream access (`fetch`, `sample_window`) and record access (`fetch_record`) over segments."""

    def __init__(self, window_size: int | None = None, stride: int | None = None):
        for name, value in (("window_size", window_size), ("stride", stride)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if stride is not None and window_size is None:
            raise ValueError("stride needs window_size")
        self.window_size = window_size
        self.stride = stride or window_size
        self._segments: list[Segment] | None = None
        self._starts: dict[str, list[int]] = {}
        self._values: dict[str, list[np.ndarray]] = {}  # key -> each segment's values
        self._shared_starts: list[int] | None = None  # set when every key has the same starts
        self._num_samples = 0

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
    ) -> Store:
        raise NotImplementedError

    # --- layout --------------------------------------------------------------------------
    def _set_segments(self, segments: list[Segment]) -> None:
        """Checks every segment has the first one's keys and dtypes; builds cumulative starts."""
        first = segments[0].columns
        for seg in segments[1:]:
            if seg.columns.keys() != first.keys():
                raise ValueError(
                    f"{seg.name}: keys {sorted(seg.columns)} differ from {segments[0].name}'s {sorted(first)}"
                )
            for key, col in seg.columns.items():
                if col.values.dtype != first[key].values.dtype:
                    raise ValueError(
                        f"{seg.name}: key {key!r} is {col.values.dtype}, {segments[0].name} has {first[key].values.dtype}"
                    )
        self._keys = list(first)
        self._starts = {
            k: _cumulative([len(s.columns[k].values) for s in segments]) for k in self._keys
        }
        self._record_starts = _cumulative([s.records for s in segments])
        self._values = {k: [s.columns[k].values for s in segments] for k in self._keys}
        starts = list(self._starts.values())
        self._shared_starts = starts[0] if all(st == starts[0] for st in starts) else None
        self._segments = segments
        if self.window_size is not None:  # fixed at load: sample_window runs once per item
            self._num_samples = window_count(
                self.token_count, self.window_size, self.stride or self.window_size
            )

    def _loaded(self) -> list[Segment]:
        if self._segments is None:
            raise RuntimeError("Store not loaded")
        return self._segments

    def _key(self, key: str) -> str:
        if key not in self._starts:
            raise KeyError(f"key {key!r} is not in this store; keys: {self.keys}")
        return key

    @property
    def keys(self) -> list[str]:
        self._loaded()
        return list(self._keys)

    @property
    def token_count(self) -> int:
        """Elements of the primary stream key (`sequence`, else the first key)."""
        self._loaded()
        return int(self._starts[primary_key(self._keys)][-1])

    @property
    def num_records(self) -> int:
        self._loaded()
        return int(self._record_starts[-1])

    @property
    def num_samples(self) -> int:
        if self.window_size is None:
            raise ValueError(
                "this store has no window_size; create it with StoreFactory.create(fmt, window_size=N)"
            )
        self._loaded()
        return self._num_samples

    def __len__(self) -> int:
        return self.num_samples if self.window_size is not None else self.num_records

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.window_size is None:
            return self.fetch_record(i, self.keys)
        return self.fetch(*self.sample_window(i), self.keys)

    # --- stream access -------------------------------------------------------------------
    def sample_window(self, i: int) -> tuple[int, int]:
        """[begin, end) of window i; the token at `end` exists, for the shifted target."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"window {i} out of range [0, {self.num_samples})")
        return window_bounds(i, self.window_size or 0, self.stride or 0)

    def fetch(self, begin: int, end: int, keys: str | list[str]) -> Any:
        """Elements [begin, end) of each key's stream (all segments concatenated)."""
        self._loaded()
        if isinstance(keys, str):
            return to_tensor(self._array(begin, end, self._key(keys)))
        inside = self._one_segment(begin, end)
        if inside is not None:  # the common case, kept to one slice and one copy per key
            s, lo, hi = inside
            try:
                return {k: torch.from_numpy(self._values[k][s][lo:hi].copy()) for k in keys}
            except KeyError:
                pass  # an unknown key: the path below names it
        return {k: to_tensor(self._array(begin, end, self._key(k))) for k in keys}

    def fetch_arrays(self, begin: int, end: int, keys: list[str]) -> dict[str, np.ndarray]:
        """fetch as numpy arrays, without the copy: inside one segment they are read-only
        views of the maps (datasets shift and widen them in the one copy they make)."""
        self._loaded()
        inside = self._one_segment(begin, end)
        if inside is not None:
            s, lo, hi = inside
            return {k: self._values[self._key(k)][s][lo:hi] for k in keys}
        return {k: self._array(begin, end, self._key(k)) for k in keys}

    def _one_segment(self, begin: int, end: int) -> tuple[int, int, int] | None:
        """(segment, local begin, local end) when every key's [begin, end) lies in one segment."""
        starts = self._shared_starts
        if starts is None:
            return None
        s = bisect_right(starts, begin) - 1
        if 0 <= begin <= end and s + 1 < len(starts) and end <= starts[s + 1]:
            return s, begin - starts[s], end - starts[s]
        return None

    def _array(self, begin: int, end: int, key: str) -> np.ndarray:
        starts = self._starts[key]
        if not 0 <= begin <= end <= starts[-1]:
            raise IndexError(f"fetch [{begin}, {end}) of key {key!r} outside [0, {starts[-1]})")
        values = self._values[key]
        s = min(bisect_right(starts, begin) - 1, len(values) - 1)
        if end <= starts[s + 1]:  # inside one segment: one slice
            return values[s][begin - starts[s] : end - starts[s]]
        pieces, pos = [], begin
        while pos < end:
            stop = min(end, starts[s + 1])
            pieces.append(values[s][pos - starts[s] : stop - starts[s]])
            pos, s = stop, s + 1
        return np.concatenate(pieces)

    # --- record access -------------------------------------------------------------------
    def fetch_record(self, i: int, keys: str | list[str]) -> Any:
        """Record i: a tensor per plain key, a list of tensors per list key."""
        if not 0 <= i < self.num_records:
            raise IndexError(f"record {i} out of range [0, {self.num_records})")
        arrays = self._record(i, [keys] if isinstance(keys, str) else list(keys))
        out = {
            k: [to_tensor(v) for v in a] if isinstance(a, list) else to_tensor(a)
            for k, a in arrays.items()
        }
        return out[keys] if isinstance(keys, str) else out

    def _record(self, i: int, keys: list[str]) -> dict[str, Any]:
        """Record i's arrays by offsets: the segment by bisection, then its offsets."""
        s = bisect_right(self._record_starts, i) - 1
        seg, local = self._loaded()[s], i - self._record_starts[s]
        return {key: _record_value(seg, self._key(key), local) for key in keys}

    def record_lengths(self, key: str) -> np.ndarray:
        """Elements of `key` in each record (all items of a list key), from offsets alone."""
        parts = []
        for seg in self._loaded():
            col = seg.columns[self._key(key)]
            if col.offsets is None:
                raise ValueError(f"{seg.name}: key {key!r} has no record offsets")
            bounds = np.asarray(
                col.offsets if col.items is None else col.items[np.asarray(col.offsets)]
            )
            parts.append(np.diff(bounds))
        return np.concatenate(parts).astype(np.int64) if parts else np.empty(0, np.int64)


def _cumulative(lengths: list[int]) -> list[int]:
    """Start of each segment and the total: bisect on this finds a position's segment (O(shards))."""
    return [0, *accumulate(int(n) for n in lengths)]


def _record_value(seg: Segment, key: str, local: int) -> Any:
    col = seg.columns[key]
    if col.offsets is None:
        raise ValueError(
            f"{seg.name}: key {key!r} has no record offsets, so it reads only as a stream (fetch)"
        )
    a, b = int(col.offsets[local]), int(col.offsets[local + 1])
    if col.items is None:
        return col.values[a:b]
    items = col.items[a : b + 1].tolist()
    return [col.values[items[j] : items[j + 1]] for j in range(b - a)]


# --- shards on disk ---------------------------------------------------------------------------
class MmapStore(Store):
    """Every shard below a folder, memory-mapped read-only; opening costs O(shards), not O(records)."""

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
    ) -> MmapStore:
        """Maps the shards below `path`; checks every file's size against meta.json.

        `tokenizer_path` is accepted and unused: shards are already tokenized.
        """
        if transform is not None or processor is not None:
            raise ValueError(
                "MmapStore reads tokenized shards; transform= and processor= are for JsonlStore"
            )
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: not a folder of shards")
        self.manifest = read_manifest(root)
        shards = find_shards(root)
        if not shards:
            raise FileNotFoundError(f"{root}: no shard (a folder with meta.json) below it")
        self._check_manifest(root, shards)
        self.root = root
        self._metas = [
            (str(d.relative_to(root)) if d != root else ".", read_meta(d)) for d in shards
        ]
        self._map()
        return self

    def _check_manifest(self, root: Path, shards: list[Path]) -> None:
        if not self.manifest:
            return
        listed = {
            f"{d}/{info['name']}" if d else info["name"]
            for d, infos in self.manifest.get("domains", {}).items()
            for info in infos
        }
        found = {d.relative_to(root).as_posix() for d in shards}
        missing = sorted(n for n in listed - found if not n.endswith(".jsonl"))
        if missing:
            raise ValueError(
                f"{root}: shards listed in manifest.json are missing: {missing[:5]}; run `tokenmill verify {root}`"
            )

    def _map(self) -> None:
        self._set_segments([_map_shard(self.root / rel, rel, meta) for rel, meta in self._metas])

    @property
    def fingerprint(self) -> str:
        """Identity of the data: a hash over every shard's name and meta.json (sizes, checksums)."""
        self._loaded()
        digest = hashlib.sha256()
        for rel, meta in self._metas:
            digest.update(f"{rel}\n{json.dumps(meta, sort_keys=True)}\n".encode())
        return digest.hexdigest()[:16]

    def verify(self) -> list[str]:
        """Every size, checksum and offsets problem of the dataset; [] when sound."""
        self._loaded()
        return verify_dataset(self.root, require_manifest=self.manifest is not None)

    def __getstate__(self) -> dict:
        """Pickles paths and metadata, never the mapped data: workers map the files themselves."""
        state = dict(self.__dict__)
        if state.get("_segments") is not None:
            state.update(_segments=None, _starts=None, _record_starts=None, _values={})
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if getattr(self, "_metas", None) is not None:
            self._map()


def _map_shard(shard: Path, rel: str, meta: dict) -> Segment:
    columns = {}
    for key, entry in meta.items():
        values = _map_file(shard / f"{key}.bin", entry["dtype"], entry["shape"][0], key)
        items = _map_bounds(shard, key, entry.get("items"), len(values))
        below = len(values) if items is None else len(items) - 1
        offsets = _map_bounds(shard, key, entry.get("offsets"), below)
        columns[key] = Column(values, offsets, items)
    return Segment(rel, columns, shard_records(meta))


def _map_file(path: Path, dtype: str, count: int, key: str) -> np.ndarray:
    """np.memmap of a flat file, after checking its size: a truncated shard fails here."""
    expected = count * DTYPES[dtype].itemsize
    size = path.stat().st_size if path.is_file() else None
    if size != expected:
        found = "missing" if size is None else f"{size} bytes"
        raise ValueError(
            f"{path}: key {key!r}: {found}, expected {expected} bytes ({count} x {dtype}); the shard is truncated or corrupted, run `tokenmill verify`"
        )
    if count == 0:
        return np.empty(0, DTYPES[dtype])
    # A plain ndarray view of the read-only map: slicing skips np.memmap's Python-level hooks.
    return np.memmap(path, dtype=DTYPES[dtype], mode="r", shape=(count,)).view(np.ndarray)


def _map_bounds(shard: Path, key: str, bounds: Any, last: int) -> np.ndarray | None:
    """Offsets or items of a key (file or seed-style inline list), first and last value checked."""
    if bounds is None:
        return None
    if isinstance(bounds, list):
        where, values = (
            f"{shard / 'meta.json'}: key {key!r}: inline offsets",
            np.asarray(bounds, OFFSET_DTYPE),
        )
    else:
        where = f"{shard / bounds['file']}: key {key!r}"
        values = _map_file(shard / bounds["file"], "int64", bounds["count"], key)
    if len(values) == 0 or values[0] != 0 or values[-1] != last:
        ends = f"{values[0]} .. {values[-1]}" if len(values) else "nothing"
        raise ValueError(f"{where}: runs {ends}, expected 0 .. {last}; run `tokenmill verify`")
    return values


# --- choosing a store by name ------------------------------------------------------------------
STORE_OPTIONS = ("window_size", "stride")


def stores() -> dict[str, type[Store]]:
    """Storage format name -> store class (JsonlStore lives in jsonl_store.py, which imports this module)."""
    from tokenmill.jsonl_store import JsonlStore

    return {"bin": MmapStore, "jsonl": JsonlStore}


def __getattr__(name: str) -> Any:
    if name == "JsonlStore":
        return stores()["jsonl"]
    raise AttributeError(f"module 'tokenmill.store' has no attribute {name!r}")


class StoreFactory:
    """Picks the store class for a storage format name ('bin' or 'jsonl')."""

    @staticmethod
    def create(
        storage_type: str, window_size: int | None = None, stride: int | None = None, **options: Any
    ) -> Store:
        classes = stores()
        if storage_type not in classes:
            raise ValueError(f"unknown storage type {storage_type!r}; valid: {sorted(classes)}")
        unknown = sorted(set(options) - set(STORE_OPTIONS))
        if unknown:
            raise TypeError(
                f"StoreFactory.create: unknown keyword(s) {unknown}; valid: {list(STORE_OPTIONS)}"
            )
        return classes[storage_type](window_size=window_size, stride=stride)
