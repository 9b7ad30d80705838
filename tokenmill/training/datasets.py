"""Datasets: a loaded Store seen as numbered training items.

Sits between the stores (`store.py`) and the sampler / dataflow roles. Stream
types (`seq`, `sft`) cut the token stream into windows here; record types (`dpo`,
`kto`, `grpo`, record_datasets.py) return one record each. `DatasetFactory` (`dataset_factory.py`) picks the
store and the class.
"""

from __future__ import annotations

import hashlib
from operator import itemgetter
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from tokenmill.shards.format import NO_POSITION, opens_document, positions_mark_documents
from tokenmill.training.store import Store
from tokenmill.training.windows import WindowBatch


class BaseDataset(Dataset):
    """Checks that the store holds `keys` and gives `fingerprint` and `sample_length`."""

    train_type: str = ""
    keys: tuple[str, ...] = ()

    def __init__(self, store: Any, max_len: int = 2048) -> None:
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        self._check_keys(store, self.keys)
        self.store = store
        self.max_len = max_len
        self._fingerprint: str | None = None

    @classmethod
    def _check_keys(cls, store: Any, keys: tuple[str, ...]) -> None:
        available = list(store.keys)
        missing = [k for k in keys if k not in available]
        if missing:
            raise ValueError(
                f"{cls.__name__} needs store keys {missing}, missing from the store; "
                f"available keys: {sorted(available)}"
            )

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_length(self, index: int) -> int:
        """Tokens in item `index`, without reading them (packing batchers call this)."""
        raise NotImplementedError

    def item_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Stream positions [first, last] that items read; None: items are records."""
        return None

    def shard_bounds(self) -> np.ndarray:
        """The first item of each shard, and the item count: items are rows (records), so
        the store's row starts (shuffle="shards" orders shards by these)."""
        return np.asarray(self.store._record_starts, dtype=np.int64)

    def _data_identity(self) -> str:
        """What identifies the data when the store has no fingerprint of its own."""
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """Stable id of (data, train type, cut parameters); resume state stores it."""
        if self._fingerprint is None:
            data = getattr(self.store, "fingerprint", None)
            data = data() if callable(data) else data
            data = data or self._data_identity()
            params = f"{self.train_type}|{self._cut_params()}|{data}"
            self._fingerprint = hashlib.sha256(params.encode()).hexdigest()[:16]
        return self._fingerprint

    def _cut_params(self) -> str:
        return f"max_len={self.max_len}"

    @property
    def tokenizer_provenance(self) -> tuple[str, str] | None:
        """(fingerprint, path) of the tokenizer the data was made with, from its manifest;
        None where the data does not say (seed-format shards, raw JSONL)."""
        manifest = getattr(self.store, "manifest", None)
        if isinstance(manifest, dict) and manifest.get("tokenizer_fingerprint"):
            return str(manifest["tokenizer_fingerprint"]), str(manifest.get("tokenizer_path"))
        return None

    def _check_index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of {n} items")
        return index + n if index < 0 else index


class _StreamDataset(BaseDataset):
    """Window i is tokens [begin, end); one more token is read for the shifted target."""

    _windows: tuple[int, int, int] | None = None

    @property
    def fixed_windows(self) -> bool:
        """Items are windows of one length: a batch of them reads as one WindowBatch."""
        return True

    def read_windows(self, indices: list[int]) -> WindowBatch:
        """Items `indices` as one WindowBatch: `tensors()` of it equals their default collation."""
        if not self.fixed_windows:
            raise ValueError(f"{type(self).__name__} items vary in length: read them one by one")
        n = len(self)
        step = self.store.stride
        size = self.store.window_size
        at = np.asarray(indices, dtype=np.int64)
        if len(at) and not (at.min() >= -n and at.max() < n):
            raise IndexError(f"an index of {indices} is out of range for {n} items")
        begins = (at % n) * step
        arrays = self.store.fetch_windows(begins, size + 1, list(self.keys))
        return WindowBatch({k: torch.from_numpy(v) for k, v in arrays.items()})

    def __len__(self) -> int:
        return int(self.store.num_windows)

    def item_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The stream positions [first, last] items read (a window and its one more token):
        what a bucket's shards are fetched ahead for (`MmapStore.prefetch_items`)."""
        first = (indices % len(self)) * int(self.store.stride)
        return first, first + int(self.store.window_size)

    def shard_bounds(self) -> np.ndarray:
        """The first window starting at or after each shard's first token, and the count."""
        n = len(self)
        starts = np.asarray(self.store._shared_starts[:-1], dtype=np.int64)
        stride = int(self.store.stride)
        return np.append(np.minimum(-(-starts // stride), n), n)

    def sample_length(self, index: int) -> int:
        windows, _, size = self._windows or self._geometry  # every window has the store's size
        if not -windows <= index < windows:
            raise IndexError(
                f"index {index} out of range for {type(self).__name__} of {windows} items"
            )
        return size

    def _window(self, index: int, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Window `index` plus one token, as numpy arrays (maybe read-only views: copy them).
        Kept to a few lines: it is most of an item's cost beyond the copy itself."""
        windows, stride, size = self._windows or self._geometry
        if not -windows <= index < windows:
            raise IndexError(
                f"index {index} out of range for {type(self).__name__} of {windows} items"
            )
        begin = (index % windows) * stride
        store = self.store
        if hasattr(store, "fetch_arrays"):
            return store.fetch_arrays(begin, begin + size + 1, keys)
        return {k: v.numpy() for k, v in store.fetch(begin, begin + size + 1, list(keys)).items()}

    @property
    def _geometry(self) -> tuple[int, int, int]:
        """(windows, stride, window size), fixed once the store is loaded."""
        if self._windows is None:
            store = self.store
            self._windows = (int(store.num_windows), int(store.stride), int(store.window_size))
        return self._windows

    def _cut_params(self) -> str:
        window = getattr(self.store, "window_size", None)
        stride = getattr(self.store, "stride", None)
        return f"window={window},stride={stride},n={len(self)}"

    def _data_identity(self) -> str:
        return f"tokens={int(self.store.token_count)}"


class SEQDataset(_StreamDataset):
    """Pretraining: `input_ids` and `target_ids`, the same window shifted by one token."""

    train_type = "seq"
    keys = ("sequence",)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        windows, stride, size = self._windows or self._geometry
        if not -windows <= index < windows:
            raise IndexError(f"index {index} out of range for SEQDataset of {windows} items")
        begin = (index % windows) * stride
        tokens = self.store.read("sequence", begin, begin + size + 1).astype(np.int64)
        # numpy slices, then from_numpy: a torch slice costs more than the window's copy
        return {
            "input_ids": torch.from_numpy(tokens[:-1]),
            "target_ids": torch.from_numpy(tokens[1:]),
        }


SAMPLES = ("row", "record", "window")
_SFT_KEYS = itemgetter("sequence", "loss_mask", "position_ids")  # SFTDataset.keys, in order


class SFTDataset(_StreamDataset):
    """SFT and instruction data: `input_ids`, `target_ids` (shifted by one), `loss_mask`
    aligned with the targets (True: that target trains) and `position_ids` aligned with the
    inputs. What one item is, by `sample`:

    - row (default): one stored row, whole conversations packed by the pipeline, never cut;
      the item also carries `doc_lengths`, its documents' lengths in `input_ids` (from the
      shards' stored boundaries), for PackedCollator's `cu_seqlens`. Each row's place and
      length are read from its shard's offsets when asked for (nothing is held per row);
      whether rows start at documents, and the longest, come from the dataset's index (a
      dataset without one has every row read once at open to tell).
    - record: one conversation (document) alone, for padding or packing at load time.
    - window: window i of the concatenated token stream (the seed's behaviour): windows
      start anywhere, mid-conversation included.

    Rows and records vary in length (pad or pack them: SFTPaddingCollator, PackedCollator);
    none may be longer than the sample, `window_size` + 1 tokens (or `max_len` + 1 for a
    store without a window), and the dataset refuses to open otherwise, naming the longest."""

    train_type = "sft"
    keys = ("sequence", "loss_mask", "position_ids")

    def __init__(self, store: Any, max_len: int = 2048, sample: str = "row") -> None:
        super().__init__(store, max_len)
        if sample not in SAMPLES:
            raise ValueError(f"sample must be one of {list(SAMPLES)}, got {sample!r}")
        self.sample = sample
        if sample == "window":
            return
        if sample == "record":
            self._starts, self._lengths = self._documents()
            longest = int(self._lengths.max()) if len(self._lengths) else 0
        else:
            longest = self._check_rows()
        limit = getattr(store, "window_size", None) or max_len
        if longest - 1 > limit:
            raise ValueError(
                f"{sample}s are longer than the sample ({limit} + 1 tokens); "
                f"the longest has {longest:,}: load with window_size >= {longest - 1}, "
                f"preprocess with max_packed_len <= {limit + 1}, or use sample='window'"
            )

    def _check_rows(self) -> int:
        """Refuses rows that start inside a document (`opens_document`); returns the longest
        row's tokens. A dataset's index tells both; else every row is read once."""
        inside = getattr(self.store, "rows_inside_documents", lambda: None)()
        longest = getattr(self.store, "longest_row", lambda key: None)("sequence")
        if inside is None or longest is None:
            lengths = np.asarray(self.store.row_lengths("sequence"), dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            inside = int(np.count_nonzero(~self._opens(starts))) if self._marks() else 0
            longest = int(lengths.max()) if len(lengths) else 0
        if inside:
            raise ValueError(
                f"{inside} rows start inside a document (the config split documents across "
                "rows: packing stream or bfd_split); use sample='record' or sample='window'"
            )
        return longest

    def _documents(self) -> tuple[np.ndarray, np.ndarray]:
        """Each document's start in the token stream and its length, by `opens_document`: the
        rows' stored `doc_lengths` pieces, joined where a piece goes on with the one before it;
        in shards written before rows stored them, each token a piece (positions tell)."""
        if "doc_lengths" not in self.store.keys:
            positions = self.store.fetch_arrays(0, self.store.token_count, ["position_ids"])
            positions = positions["position_ids"]
            inner = np.flatnonzero(opens_document(positions[1:], positions[:-1])) + 1
            starts = np.concatenate([[0] if len(positions) else [], inner]).astype(np.int64)
        else:
            total = int(np.asarray(self.store.row_lengths("doc_lengths")).sum())
            pieces = self.store.fetch(0, total, "doc_lengths").numpy().astype(np.int64)
            piece_starts = np.concatenate([[0], np.cumsum(pieces)[:-1]]).astype(np.int64)
            if self._marks():
                opens = self._opens(piece_starts)
                # a piece that opens a document but not at position 0: the rest of one that
                # bfd_split placed apart from its start
                apart = opens & (self.store.gather("position_ids", piece_starts) != 0)
                apart[:1] = False
                if apart.any():
                    raise ValueError(
                        f"{int(apart.sum())} documents were split into pieces that are not next "
                        "to each other (packing bfd_split); use sample='row' or sample='window'"
                    )
                piece_starts = piece_starts[opens]
            starts = piece_starts
        ends = np.append(starts[1:], int(self.store.token_count))
        return starts, ends - starts

    def _opens(self, starts: np.ndarray) -> np.ndarray:
        """Which pieces of the token stream that start at `starts` open a document."""
        if not len(starts):
            return np.zeros(0, dtype=bool)
        first = self.store.gather("position_ids", starts)
        before = np.asarray(self.store.gather("position_ids", np.maximum(starts - 1, 0)), np.int64)
        before[0] = NO_POSITION
        return opens_document(first, before)

    def _marks(self) -> bool:
        """Whether the store's positions tell its documents apart (`positions_mark_documents`)."""
        manifest = getattr(self.store, "manifest", None)
        return positions_mark_documents(manifest if isinstance(manifest, dict) else None)

    def __len__(self) -> int:
        if self.sample == "row":
            return int(self.store.num_rows)
        return super().__len__() if self.sample == "window" else len(self._lengths)

    def shard_bounds(self) -> np.ndarray:
        if self.sample == "row":
            return BaseDataset.shard_bounds(self)
        if self.sample == "window":
            return super().shard_bounds()
        starts = np.asarray(self.store._shared_starts[:-1], dtype=np.int64)
        return np.append(np.searchsorted(self._starts, starts, side="left"), len(self))

    def _span(self, index: int) -> tuple[int, int]:
        """(start in the token stream, tokens) of item `index` (a row or a record)."""
        if self.sample == "row":
            return self.store.row_span(index, "sequence")
        return int(self._starts[index]), int(self._lengths[index])

    @property
    def fixed_windows(self) -> bool:
        return self.sample == "window"

    def item_ranges(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        if self.sample == "window":
            return super().item_ranges(indices)
        if self.sample == "row":
            first, lengths = self.store.row_spans(np.asarray(indices) % len(self), "sequence")
        else:
            first, lengths = self._starts[indices], self._lengths[indices]
        return first, first + np.maximum(lengths - 1, 0)

    def sample_length(self, index: int) -> int:
        if self.sample == "window":
            return super().sample_length(index)
        return self._span(self._check_index(index))[1] - 1

    def _cut_params(self) -> str:
        return super()._cut_params() if self.sample == "window" else f"sample={self.sample}"

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sample = self.sample
        if sample == "window":
            if isinstance(self.store, Store):
                return self._window_item(index)
            data = self._window(index, self.keys)
        else:
            index = self._check_index(index)
            begin, length = self._span(index)
            data = self.store.fetch_arrays(begin, begin + length, list(self.keys))
        tokens = data["sequence"].astype(np.int64)  # the one copy, widened; astype always copies
        item = {
            "input_ids": torch.from_numpy(tokens[:-1]),
            "target_ids": torch.from_numpy(tokens[1:]),
            "loss_mask": torch.from_numpy(data["loss_mask"][1:].astype(np.bool_)),
            "position_ids": torch.from_numpy(data["position_ids"][:-1].astype(np.int64)),
        }
        # rows without stored boundaries (older shards) leave them to positions
        if sample == "record" or (sample == "row" and "doc_lengths" in self.store.keys):
            item["doc_lengths"] = self._doc_lengths(index, len(tokens) - 1)
        return item

    def _window_item(self, index: int) -> dict[str, torch.Tensor]:
        """`__getitem__` of a window from a Store: each key sliced straight from the map to
        the part the item keeps (the same tensors, fewer Python steps per item)."""
        windows, stride, size = self._windows or self._geometry
        if not -windows <= index < windows:
            raise IndexError(
                f"index {index} out of range for {type(self).__name__} of {windows} items"
            )
        begin = (index % windows) * stride
        found = self.store.locate(begin, begin + size + 1)
        values, lo = found if found is not None else ({}, 0)
        try:
            tokens, mask, positions = _SFT_KEYS(values)
        except KeyError:  # across views (none found), or a key outside the stream: copies
            values, lo = self.store.fetch_arrays(begin, begin + size + 1, self.keys), 0
            tokens, mask, positions = _SFT_KEYS(values)
        hi = lo + size + 1
        ids = tokens[lo:hi].astype(np.int64)  # the one copy, widened
        return {
            "input_ids": torch.from_numpy(ids[:-1]),
            "target_ids": torch.from_numpy(ids[1:]),
            "loss_mask": torch.from_numpy(mask[lo + 1 : hi].astype(np.bool_)),
            "position_ids": torch.from_numpy(positions[lo : hi - 1].astype(np.int64)),
        }

    def _doc_lengths(self, index: int, inputs: int) -> torch.Tensor:
        """The documents of item `index` as lengths in its inputs (the last one a token short)."""
        if self.sample == "record":
            return torch.tensor([inputs] if inputs else [], dtype=torch.int64)
        lengths = self.store.fetch_row(index, "doc_lengths").to(torch.int64)
        lengths[-1] -= 1
        return lengths[lengths > 0]
