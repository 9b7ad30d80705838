"""The Store interface: stream access by window and row access by offsets.

`fetch(begin, end, keys)` reads a key's stream across shard boundaries;
`fetch_row(i, keys)` reads row i by its offsets. MmapStore (shards) and JsonlStore
(raw or pre-tokenized JSONL) fill it with views: one per shard, or one in-memory load; what
a store holds open of them between reads is open_views.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.shards.format import Column, primary_key
from tokenmill.training.open_views import OpenViews, ShardView, view_at

Transform = Callable[[dict], dict]


def window_count(token_count: int, window_size: int, stride: int) -> int:
    """Windows [i*stride, i*stride + window_size) that leave one more token for the shifted target."""
    if token_count <= window_size:
        return 0
    return (token_count - 1 - window_size) // stride + 1


def window_bounds(i: int, window_size: int, stride: int) -> tuple[int, int]:
    return i * stride, i * stride + window_size


def to_tensor(values: Any) -> torch.Tensor:
    """A writable copy of just these values (memmap slices are read-only)."""
    return torch.from_numpy(np.array(values))


class _KeyValues:
    """One key's values, view by view: `values[s]` opens view s on first use."""

    def __init__(self, store: Store, key: str) -> None:
        self.store, self.key = store, key

    def __getitem__(self, s: int) -> np.ndarray:
        return self.store._key_values(s, self.key)


class Store(OpenViews):
    """Stream access (`fetch`, `window_at`) and row access (`fetch_row`) over views."""

    def __init__(self, window_size: int | None = None, stride: int | None = None):
        for name, value in (("window_size", window_size), ("stride", stride)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if stride is not None and window_size is None:
            raise ValueError("stride needs window_size")
        self.window_size = window_size
        self.stride = stride or window_size
        self._starts: dict[str, np.ndarray] = {}
        self._record_starts: np.ndarray = NO_STARTS
        self._values: dict[str, _KeyValues] = {}  # key -> each view's values
        self._shared_starts: np.ndarray = NO_STARTS  # the primary key's view starts
        self._stream_keys: set[str] = set()  # the keys whose views start where the primary's do
        self._num_windows = 0
        self._hold(None)

    def load(
        self,
        path: str | Path,
        transform: Transform | None = None,
        processor: Transform | None = None,
        tokenizer_path: str | Path | None = None,
    ) -> Store:
        raise NotImplementedError

    # --- layout --------------------------------------------------------------------------
    def _set_views(self, views: list[ShardView], files_per_view: int = 0) -> None:
        """Views all in hand (JSONL, a dataset without index): checks every view has the first
        one's keys and dtypes; builds cumulative starts."""
        first = views[0].dtypes
        for view in views[1:]:
            if view.dtypes.keys() != first.keys():
                raise ValueError(
                    f"{view.name}: keys {sorted(view.dtypes)} differ from {views[0].name}'s {sorted(first)}"
                )
            for key, dtype in view.dtypes.items():
                if dtype != first[key]:
                    raise ValueError(
                        f"{view.name}: key {key!r} is {dtype}, {views[0].name} has {first[key]}"
                    )
        starts = {k: cumulative([s.sizes[k] for s in views]) for k in first}
        records = cumulative([s.records for s in views])
        self._set_layout(starts, records, first, views, files_per_view)

    def _set_layout(
        self,
        starts: dict[str, np.ndarray],
        record_starts: np.ndarray,
        dtypes: dict[str, np.dtype],
        views: Sequence[ShardView],
        files_per_view: int = 0,
        stream_keys: list[str] | None = None,
    ) -> None:
        """The store's layout: each key's and the records' cumulative view starts (arrays: a
        dataset's index maps them, so they cost no heap per shard), the keys' dtypes, the
        views (made on demand where the store has many), the files a view holds open and
        the stream keys (where an index names them: no start is read at load)."""
        self._keys, self._dtypes = list(dtypes), dtypes
        self._starts, self._record_starts = starts, record_starts
        self._values = {k: _KeyValues(self, k) for k in self._keys}
        self._shared_starts = self._starts[primary_key(self._keys)]
        if stream_keys is None:  # the keys whose views start where the primary's do
            stream_keys = [k for k, st in starts.items() if np.array_equal(st, self._shared_starts)]
        self._stream_keys = set(stream_keys)
        self._hold(views, files_per_view)
        if self.window_size is not None:  # fixed at load: window_at runs once per item
            self._num_windows = window_count(
                self.token_count, self.window_size, self.stride or self.window_size
            )

    def _key_values(self, s: int, key: str) -> np.ndarray:
        """View s's values of one key. A store that can open one key of a view alone (a
        remote one: one file to download, not the shard) overrides this and `_key_bounds`;
        reads across views and index-time scans (`gather`, `row_lengths`) go through them."""
        return self._columns(s)[key].values

    def _key_bounds(self, s: int, key: str) -> Column:
        """View s's column of one key, for its offsets and items (its values may be empty)."""
        return self._columns(s)[key]

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
        return int(self._shared_starts[-1])

    @property
    def num_rows(self) -> int:
        self._loaded()
        return int(self._record_starts[-1])

    @property
    def num_windows(self) -> int:
        if self.window_size is None:
            raise ValueError(
                "this store has no window_size; create it with StoreFactory.create(fmt, window_size=N)"
            )
        self._loaded()
        return self._num_windows

    def __len__(self) -> int:
        return self.num_windows if self.window_size is not None else self.num_rows

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.window_size is None:
            return self.fetch_row(i, self.keys)
        return self.fetch(*self.window_at(i), self.keys)

    # --- stream access -------------------------------------------------------------------
    def window_at(self, i: int) -> tuple[int, int]:
        """[begin, end) of window i; the token at `end` exists, for the shifted target."""
        if not 0 <= i < self._num_windows:
            raise IndexError(f"window {i} out of range [0, {self.num_windows})")
        return window_bounds(i, self.window_size or 0, self.stride or 0)

    def fetch(self, begin: int, end: int, keys: str | list[str]) -> Any:
        """Elements [begin, end) of each key's stream (all views concatenated)."""
        self._loaded()
        if isinstance(keys, str):
            return to_tensor(self._array(begin, end, self._key(keys)))
        inside = self._one_view(begin, end, keys)
        if inside is not None:  # the common case, kept to one slice and one copy per key
            s, lo, hi = inside
            columns = self._columns(s)
            return {k: torch.from_numpy(columns[k].values[lo:hi].copy()) for k in keys}
        return {k: to_tensor(self._array(begin, end, self._key(k))) for k in keys}

    def fetch_arrays(self, begin: int, end: int, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """fetch as numpy arrays, without the copy: inside one view they are read-only
        views of the maps (datasets shift and widen them in the one copy they make)."""
        found = self.locate(begin, end) if self._stream_keys.issuperset(keys) else None
        if found is not None:  # the common case: one slice per key
            values, lo = found
            return {k: values[k][lo : lo + end - begin] for k in keys}
        self._loaded()
        return {k: self._array(begin, end, self._key(k)) for k in keys}

    def locate(self, begin: int, end: int) -> tuple[dict[str, np.ndarray], int] | None:
        """(each stream key's values in the one view holding [begin, end) whole, begin's
        position in them), read-only maps, no copy; None if the range crosses views or lies
        outside. An item slices just what it keeps from them, the least Python per item."""
        _, start, stop, values = self._hot
        if start <= begin <= end <= stop:  # inside the view read last
            return values, begin - start
        starts = self._shared_starts  # empty before load: _loaded() below then raises
        s = view_at(starts, begin)
        self._loaded()
        if 0 <= begin <= end and s + 1 < len(starts) and end <= starts[s + 1]:
            return self._heat(s)[3], begin - int(starts[s])
        return None

    def fetch_windows(
        self, begins: np.ndarray, length: int, keys: list[str]
    ) -> dict[str, np.ndarray]:
        """[len(begins), length] of each key's stream, row j from begins[j]: a batch of windows
        read into one array per key (a slice copy per row), with no item per window."""
        self._loaded()
        dtypes = self._dtypes
        out = {k: np.empty((len(begins), length), dtype=dtypes[self._key(k)]) for k in keys}
        for j, begin in enumerate(np.asarray(begins, dtype=np.int64).tolist()):
            inside = self._one_view(begin, begin + length, keys)
            if inside is not None:
                s, lo, hi = inside
                columns = self._columns(s)
                for k in keys:
                    out[k][j] = columns[k].values[lo:hi]
            else:
                for k in keys:
                    out[k][j] = self._array(begin, begin + length, k)
        return out

    def _one_view(self, begin: int, end: int, keys: list[str]) -> tuple[int, int, int] | None:
        """(view, local begin, local end) when every key's [begin, end) lies in one view (keys
        outside the primary's stream, or unknown, take the slower path, which names them)."""
        starts = self._shared_starts
        if not self._stream_keys.issuperset(keys):
            return None
        s = view_at(starts, begin)
        if 0 <= begin <= end and s + 1 < len(starts) and end <= starts[s + 1]:
            return s, begin - int(starts[s]), end - int(starts[s])
        return None

    def gather(self, key: str, indices: np.ndarray) -> np.ndarray:
        """A key's stream values at these positions, read view by view: index-time checks
        (rows and documents at load) touch those values only, not the whole stream."""
        self._loaded()
        starts = self._starts[self._key(key)]
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and not (0 <= indices.min() and indices.max() < starts[-1]):
            raise IndexError(f"gather of key {key!r} outside [0, {starts[-1]})")
        view = np.searchsorted(starts, indices, side="right") - 1
        out = np.empty(len(indices), dtype=self._dtypes[key])
        for s in np.unique(view).tolist():
            at = view == s
            out[at] = self._values[key][s][indices[at] - starts[s]]
        return out

    def read(self, key: str, begin: int, end: int) -> np.ndarray:
        """Elements [begin, end) of one key's stream: a read-only view of the map inside one
        view, else a copy joined across views. The shortest way to a window (SEQ items)."""
        _, start, stop, values = self._hot
        if start <= begin <= end <= stop:  # inside the view read last
            array = values.get(key)
            if array is not None:
                return array[begin - start : end - start]
        found = self.locate(begin, end) if key in self._stream_keys else None
        if found is not None:  # locate made the view holding them the view read last
            return found[0][key][found[1] : found[1] + end - begin]
        self._loaded()
        return self._array(begin, end, self._key(key))

    def _array(self, begin: int, end: int, key: str) -> np.ndarray:
        starts = self._starts[key]
        if not 0 <= begin <= end <= starts[-1]:
            raise IndexError(f"fetch [{begin}, {end}) of key {key!r} outside [0, {starts[-1]})")
        s = min(view_at(starts, begin), len(starts) - 2)
        if end <= starts[s + 1]:  # inside one view: one slice
            return self._columns(s)[key].values[begin - starts[s] : end - starts[s]]
        values = self._values[key]
        pieces, pos = [], begin
        while pos < end:
            stop = min(end, int(starts[s + 1]))
            pieces.append(values[s][pos - starts[s] : stop - starts[s]])
            pos, s = stop, s + 1
        return np.concatenate(pieces)

    # --- row access ----------------------------------------------------------------------
    def fetch_row(self, i: int, keys: str | list[str]) -> Any:
        """Row i: a tensor per plain key, a list of tensors per list key."""
        if not isinstance(keys, str):
            return {key: self.fetch_row(i, key) for key in keys}
        s = view_at(self._record_starts, i)
        # a plain key of a view read before: near the raw read's cost (records are small, many)
        found = self._records.get((s, keys))  # none past the ends: _value raises
        if found is None:
            return as_tensors(self._value(i, keys))
        if s != self._last and s in self._opened:  # the LRU's order stays exact
            self._opened.move_to_end(s)
            self._last = s
        first, offsets, values = found
        return torch.from_numpy(np.array(values[offsets[i - first] : offsets[i - first + 1]]))

    def _value(self, i: int, key: str) -> Any:
        """Record i's array of `key` (a list of arrays for a list key), by bisection; a plain
        key's maps are kept for fetch_row while the view stays open."""
        starts = self._record_starts
        s = view_at(starts, i)
        if i < 0 or s + 1 >= len(starts):
            raise IndexError(f"row {i} out of range [0, {self.num_rows})")
        col = self._columns(s).get(key)
        if col is None or col.offsets is None:
            self._key(key)  # names a key that is not in the store
            raise ValueError(
                f"{self._loaded()[s].name}: key {key!r} has no row offsets, so it reads "
                "only as a stream (fetch)"
            )
        first = int(starts[s])
        if col.items is None and self._held(s):  # kept while the view stays open
            self._records[s, key] = (first, col.offsets, col.values)
        begin, end = col.offsets[i - first], col.offsets[i - first + 1]
        if col.items is None:
            return col.values[begin:end]
        items = col.items[begin : end + 1].tolist()
        return [col.values[items[j] : items[j + 1]] for j in range(end - begin)]

    def row_span(self, i: int, key: str) -> tuple[int, int]:
        """(start in `key`'s stream, elements) of row i (all items of a list key), from the
        offsets of the one view holding it: what a lazily measured row costs."""
        self._loaded()
        starts = self._record_starts
        s = view_at(starts, i)
        if i < 0 or s + 1 >= len(starts):
            raise IndexError(f"row {i} out of range [0, {self.num_rows})")
        col = self._key_bounds(s, self._key(key))
        if col.offsets is None:
            raise ValueError(f"{self._loaded()[s].name}: key {key!r} has no row offsets")
        j = i - int(starts[s])
        begin, end = int(col.offsets[j]), int(col.offsets[j + 1])
        if col.items is not None:
            begin, end = int(col.items[begin]), int(col.items[end])
        return int(self._starts[key][s]) + begin, end - begin

    def row_spans(self, rows: np.ndarray, key: str) -> tuple[np.ndarray, np.ndarray]:
        """`row_span` of many rows at once, each view's offsets read once."""
        self._loaded()
        rows = np.asarray(rows, dtype=np.int64)
        starts = self._record_starts
        if len(rows) and not (0 <= rows.min() and rows.max() < starts[-1]):
            raise IndexError(f"a row of {rows.tolist()[:8]} is out of range [0, {starts[-1]})")
        views = np.searchsorted(starts, rows, side="right") - 1
        begin, length = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        for s in np.unique(views).tolist():
            at = views == s
            col = self._key_bounds(s, self._key(key))
            if col.offsets is None:
                raise ValueError(f"{self._loaded()[s].name}: key {key!r} has no row offsets")
            j = rows[at] - starts[s]
            lo, hi = col.offsets[j], col.offsets[j + 1]
            if col.items is not None:
                lo, hi = col.items[lo], col.items[hi]
            begin[at], length[at] = self._starts[key][s] + lo, hi - lo
        return begin, length

    def longest_row(self, key: str) -> int | None:
        """The most elements of `key` in one row, where the store knows it without reading
        every row (a dataset's index records it); None where it does not."""
        return None

    def rows_inside_documents(self) -> int | None:
        """Rows that start inside a document, where the store knows it without reading them
        (recorded at preprocessing, in the index); None where it does not."""
        return None

    def row_lengths(self, key: str) -> np.ndarray:
        """Elements of `key` in each row (all items of a list key), from offsets alone."""
        views = []
        for s, view in enumerate(self._loaded()):
            col = self._key_bounds(s, self._key(key))
            if col.offsets is None:
                raise ValueError(f"{view.name}: key {key!r} has no row offsets")
            views.append(np.diff(col.offsets if col.items is None else col.items[col.offsets]))
        return np.concatenate(views).astype(np.int64) if views else np.empty(0, np.int64)

    # --- names before the vocabulary of docs/dataflow.md (a stored record is a row) ----------
    def fetch_record(self, i: int, keys: str | list[str]) -> Any:
        """Deprecated: `fetch_row`."""
        return self.fetch_row(i, keys)

    @property
    def num_records(self) -> int:
        """Deprecated: `num_rows`."""
        return self.num_rows

    def record_lengths(self, key: str) -> np.ndarray:
        """Deprecated: `row_lengths`."""
        return self.row_lengths(key)

    @property
    def num_samples(self) -> int:
        """Deprecated: `num_windows`."""
        return self.num_windows

    def sample_window(self, i: int) -> tuple[int, int]:
        """Deprecated: `window_at`."""
        return self.window_at(i)


NO_STARTS = np.zeros(1, dtype=np.int64)  # a store's starts before load: no view


def cumulative(lengths: Sequence[int]) -> np.ndarray:
    """Start of each view and the total (`view_at` finds a position's view in it)."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def as_tensors(value: Any) -> Any:
    """A row's array as a tensor, a list key's arrays as a list of tensors (writable copies)."""
    return [to_tensor(v) for v in value] if isinstance(value, list) else to_tensor(value)
