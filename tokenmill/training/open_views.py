"""Views and what a store holds open of them between reads.

A view is one shard (or one in-memory JSONL load): its sizes and dtypes, and its columns,
given or opened on first use. A store keeps at most `max_open_shards` opened views, and no
more than their files fit in an eighth of the process's open-file limit (least recently
read closed first: an open shard holds a file descriptor per file), the view read
last with its stream values (`_hot`: an item inside it is one slice), and the record maps
of plain keys of open views (`fetch_row`'s short way). Whatever the limit closes, every
one of them forgets; none is pickled: a copy opens its own.
"""

from __future__ import annotations

import resource
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.shards.format import Column

Hot = tuple[int, int, int, dict[str, np.ndarray]]  # view read last: start, end, stream values
Record = tuple[int, np.ndarray, np.ndarray]  # a view's first record, a plain key's offsets, values
NO_HOT: Hot = (-1, 0, -1, {})
MAX_OPEN_SHARDS = 32  # an open shard holds a file descriptor per file (Python < 3.13 mmap); the limit is often 1,024
FILE_SHARE = 8  # a store holds open at most 1/FILE_SHARE of the open-file limit: several fit


def open_file_budget() -> int:
    """The files one store may hold mapped: a share of the process's open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(1, soft // FILE_SHARE)


def view_at(starts: np.ndarray, position: int) -> int:
    """The view holding `position`, by its cumulative starts (-1 before the first)."""
    return int(starts.searchsorted(position, "right")) - 1


@dataclass
class ShardView:
    """One shard (or one in-memory JSONL load): its record count, each key's element count
    and dtype, and its columns: given (in memory) or opened by `open` on first use."""

    name: str
    records: int
    sizes: dict[str, int]
    dtypes: dict[str, np.dtype]
    columns: dict[str, Column] | None = None
    open: Callable[[], dict[str, Column]] | None = None

    @classmethod
    def of(cls, name: str, columns: dict[str, Column], records: int) -> ShardView:
        """A view of columns already in memory."""
        sizes = {k: len(c.values) for k, c in columns.items()}
        return cls(name, records, sizes, {k: c.values.dtype for k, c in columns.items()}, columns)


class OpenViews:
    """A store's views and what it holds open of them (see the module docstring); the store
    reads `_hot`, `_opened` and `_records` straight, on its shortest paths."""

    max_open_shards = MAX_OPEN_SHARDS
    _shared_starts: np.ndarray  # the store's: where each view starts in the primary stream
    _stream_keys: set[str]  # the store's: the keys whose views start where the primary's do

    def _hold(self, views: Sequence[ShardView] | None, files_per_view: int = 0) -> None:
        """These views (None: not loaded), none of them open yet; opening one maps
        `files_per_view` files (0: views in memory)."""
        self._views = views
        self._in_memory = bool(views) and views[0].columns is not None  # type: ignore[index]
        self._max_open_by_files = max(1, open_file_budget() // max(files_per_view, 1))
        self._opened: OrderedDict[int, dict[str, Column]] = OrderedDict()
        self._hot: Hot = NO_HOT
        self._last = -1  # the view touched last: already the most recent in `_opened`
        self._view_values: dict[int, dict[str, np.ndarray]] = {}  # stream keys of open views
        self._records: dict[tuple[int, str], Record] = {}  # (view, plain key) read by record

    def __getstate__(self) -> dict:
        """Nothing held open is pickled: a copy opens its own on its first read."""
        return {
            **self.__dict__,
            "_opened": OrderedDict(),
            "_hot": NO_HOT,
            "_last": -1,
            "_view_values": {},
            "_records": {},
        }

    def _loaded(self) -> Sequence[ShardView]:
        if self._views is None:
            raise RuntimeError("Store not loaded")
        return self._views

    def _held(self, s: int) -> bool:
        """View s stays at hand: in memory, or among the open shards (not past the limit)."""
        return s in self._opened or self._in_memory

    def _columns(self, s: int) -> dict[str, Column]:
        """View s's columns; a lazily opened view stays open among the `max_open_shards` most
        recently used, so a store of thousands of shards keeps few files mapped. Reads of the
        view touched last skip the LRU's bookkeeping: it is already the most recent."""
        columns = self._opened.get(s)
        if columns is not None:
            if s != self._last:
                self._opened.move_to_end(s)
                self._last = s
            return columns
        view = self._loaded()[s]
        if view.columns is not None:
            return view.columns
        assert view.open is not None, "a view has columns or a way to open them"
        columns = self._opened[s] = view.open()
        self._last = s
        while len(self._opened) > min(self.max_open_shards, self._max_open_by_files):
            closed, _ = self._opened.popitem(last=False)
            self._view_values.pop(closed, None)
            self._records = {at: r for at, r in self._records.items() if at[0] != closed}
            if closed == self._hot[0]:  # never hold a view the limit closed
                self._hot = NO_HOT
        return columns

    def _heat(self, s: int) -> Hot:
        """View s as the view read last (`_hot`, one assignment: threads may read)."""
        columns = self._columns(s)
        values = self._view_values.get(s) or {k: columns[k].values for k in self._stream_keys}
        hot = (s, self._shared_starts[s], self._shared_starts[s + 1], values)
        if self._held(s):
            self._view_values[s], self._hot = values, hot
        return hot
