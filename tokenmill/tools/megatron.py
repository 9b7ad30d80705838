"""Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), read and written here.

The layout is megatron-core's (`megatron/core/datasets/indexed_dataset.py`), kept byte for
byte so that its `IndexedDataset(PREFIX)` reads what we write and we read what its
`IndexedDatasetBuilder` writes, without megatron-core (and its torch import) at run time:

    .idx  b"MMIDIDX\\x00\\x00" | <Q version 1 | <B dtype code | <Q sequence count S
          | <Q document_indices count D + 1 | int32 lengths[S] | int64 byte pointers[S]
          | int64 document_indices[D + 1] (first sequence of each document, then S)
          | int8 modes[S] (multimodal datasets only)
    .bin  every sequence's tokens, back to back, in the index's dtype
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.shards.files import fsync_dir, tmp_path

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
_FIXED = len(HEADER) + 8 + 1 + 8 + 8  # header, version, dtype code, two counts: 34 bytes


# megatron-core's DType enum: code -> numpy dtype
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}


def paths(prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.bin, PREFIX.idx); a prefix given with either suffix means the same corpus."""
    text = str(prefix)
    if text.endswith((".bin", ".idx")):
        text = text[:-4]
    return Path(text + ".bin"), Path(text + ".idx")


@dataclass
class MegatronCorpus:
    """A Megatron corpus, memory-mapped: its index arrays and its tokens."""

    prefix: str
    dtype: np.dtype
    lengths: np.ndarray  # int32, tokens per sequence
    pointers: np.ndarray  # int64, byte offset of each sequence in .bin
    document_indices: np.ndarray  # int64, first sequence of each document, then the count
    tokens: np.ndarray  # the whole .bin in `dtype`

    @property
    def documents(self) -> int:
        return len(self.document_indices) - 1

    def document(self, d: int) -> np.ndarray:
        """Document d's tokens: its sequences in order (a view of .bin when they are adjacent)."""
        first, stop = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if first == stop:
            return self.tokens[:0]
        starts = self.pointers[first:stop] // self.dtype.itemsize
        ends = starts + self.lengths[first:stop]
        if np.array_equal(starts[1:], ends[:-1]):  # adjacent, as every Megatron writer puts them
            return self.tokens[int(starts[0]) : int(ends[-1])]
        return np.concatenate([self.sequence(s) for s in range(first, stop)])

    def sequence(self, s: int) -> np.ndarray:
        start = int(self.pointers[s]) // self.dtype.itemsize
        return self.tokens[start : start + int(self.lengths[s])]


def read_megatron(prefix: str | Path) -> MegatronCorpus:
    """Maps PREFIX.bin/.idx read-only, after checking the index against itself and the data."""
    bin_path, idx_path = paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: not found (a Megatron corpus is PREFIX.bin + PREFIX.idx)"
            )
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        fixed = f.read(_FIXED)
    if len(fixed) < _FIXED or fixed[: len(HEADER)] != HEADER:
        raise ValueError(f"{idx_path}: not a Megatron index (no MMIDIDX header)")
    version, code, count, doc_count = struct.unpack("<QBQQ", fixed[len(HEADER) :])
    if version != VERSION:
        raise ValueError(f"{idx_path}: index version {version}; only version {VERSION} is known")
    if code not in DTYPE_CODES or DTYPE_CODES[code].kind == "f":
        raise ValueError(f"{idx_path}: dtype code {code} is not an integer token type")
    dtype = DTYPE_CODES[code]
    expected = _FIXED + count * (4 + 8) + doc_count * 8
    if size == expected + count:
        raise ValueError(f"{idx_path}: a multimodal index (sequence modes); not supported")
    if size != expected or doc_count < 1:
        raise ValueError(
            f"{idx_path}: {size} bytes, expected {expected} for {count} sequences and "
            f"{doc_count} document indices: truncated or not a Megatron index"
        )
    index = np.memmap(idx_path, dtype=np.uint8, mode="r")
    lengths = index[_FIXED : _FIXED + 4 * count].view("<i4")
    pointers = index[_FIXED + 4 * count : _FIXED + 12 * count].view("<i8")
    document_indices = index[_FIXED + 12 * count : expected].view("<i8")
    where = f"{idx_path}:"
    if len(lengths) and int(lengths.min()) < 0:
        raise ValueError(f"{where} a negative sequence length")
    if document_indices[0] != 0 or document_indices[-1] != count:
        raise ValueError(
            f"{where} document indices run {document_indices[0]} .. {document_indices[-1]}, "
            f"expected 0 .. {count}"
        )
    if np.any(np.diff(document_indices) < 0):
        raise ValueError(f"{where} document indices are not in order")
    data_size = bin_path.stat().st_size
    ends = pointers + lengths.astype(np.int64) * dtype.itemsize
    if count and (
        int(pointers.min()) < 0 or np.any(pointers % dtype.itemsize) or int(ends.max()) > data_size
    ):
        raise ValueError(
            f"{bin_path}: {data_size} bytes, but the index points to sequences beyond it "
            f"(or not at whole {dtype} tokens): truncated, or not this index's data"
        )
    tokens = (
        np.memmap(bin_path, dtype=dtype.newbyteorder("<"), mode="r")
        if data_size >= dtype.itemsize
        else np.empty(0, dtype)
    )
    return MegatronCorpus(str(prefix), dtype, lengths, pointers, document_indices, tokens)


def token_dtype(low: int, high: int) -> np.dtype:
    """The narrowest dtype Megatron takes for token ids in [low, high]: uint16 or int32 (as its
    `DType.optimal_dtype`), int64 beyond that."""
    for dtype in (np.uint16, np.int32, np.int64):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return np.dtype(dtype)
    raise ValueError(f"token ids in [{low}, {high}] fit no Megatron dtype")


def write_megatron(
    prefix: str | Path, dtype: np.dtype, lengths: np.ndarray, tokens: Iterable[np.ndarray]
) -> tuple[Path, Path]:
    """Writes PREFIX.bin (the `tokens` chunks, back to back) and PREFIX.idx, one sequence and
    one document per entry of `lengths`; each file written aside, fsynced and renamed into
    place, the index last, so a reader never pairs a new index with old data."""
    bin_path, idx_path = paths(prefix)
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and int(lengths.max()) > np.iinfo(np.int32).max:
        raise ValueError(
            f"a document of {int(lengths.max()):,} tokens: Megatron stores lengths as int32"
        )
    code = next(c for c, d in DTYPE_CODES.items() if d == dtype)
    pointers = np.zeros(len(lengths), dtype="<i8")
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    tmp_bin, tmp_idx = tmp_path(bin_path), tmp_path(idx_path)
    try:
        written = 0
        with open(tmp_bin, "wb") as f:
            for chunk in tokens:
                np.ascontiguousarray(chunk, dtype=dtype.newbyteorder("<")).tofile(f)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        if written != int(lengths.sum()):
            raise RuntimeError(f"wrote {written} tokens, the lengths add up to {lengths.sum()}")
        with open(tmp_idx, "wb") as f:
            f.write(HEADER + struct.pack("<QBQQ", VERSION, code, len(lengths), len(lengths) + 1))
            lengths.astype("<i4").tofile(f)
            pointers.tofile(f)
            np.arange(len(lengths) + 1, dtype="<i8").tofile(f)  # each sequence a document
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    except BaseException:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
        raise
    fsync_dir(bin_path.parent)
    return bin_path, idx_path
