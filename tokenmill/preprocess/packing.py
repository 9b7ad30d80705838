"""Packing: place tokenized documents into rows of at most `max_len` tokens.

Sits between masking.py (one record -> its arrays) and the shard writer: the
pipeline plans rows from a pool's document lengths, applies the plan to every
per-document key (`sequence`, `loss_mask`, ...) and adds `position_ids` per row.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np

PackingStrategy = Literal["simple", "bfd", "bfd_split", "stream"]


PositionIdsMode = Literal["none", "doc_reset", "continuous"]


PACKING_STRATEGIES: tuple[str, ...] = get_args(PackingStrategy)


POSITION_IDS_MODES: tuple[str, ...] = get_args(PositionIdsMode)


Piece = tuple[int, int, int]
"""(doc_index, start, end): the token range [start, end) of one document placed in a row."""


def plan_packing(
    lengths: Sequence[int] | np.ndarray, max_len: int, strategy: str
) -> tuple[list[list[Piece]], int]:
    """Plan rows for documents of `lengths`; return (rows, dropped_tokens).

    - simple: documents in input order, a new row when the next one does not fit.
    - bfd: best-fit decreasing over whole documents.
    - bfd_split: bfd, but a document over `max_len` is cut into `max_len` pieces
      (each its own row) plus a remainder packed by best fit; nothing is dropped. The
      rows of full pieces come first, and those of the document whose remainder opens
      the next row come last among them, so that in the stream of rows, doc_reset
      positions alone tell documents apart (what PackedCollator relies on).
    - stream: documents in input order, each row filled to `max_len`: a document that
      does not fit continues in the next row (its positions go on); nothing is dropped.
      What pretraining wants: the rows' concatenation is every document in order.
    simple and bfd keep the first `max_len` tokens of a longer document, alone in
    its row, and count the rest as dropped (the ledger's packing_overflow). Zero-length documents get no piece and
    no row: an empty row would be a record without tokens downstream.
    Rows come in order of creation, pieces in placement order. bfd usually needs
    fewer rows than simple, never more than simple over longest-first order, but
    can need more on an input order that happens to tile well.
    """
    if strategy not in PACKING_STRATEGIES:
        raise ValueError(
            f"unknown packing strategy {strategy!r}: expected one of [{', '.join(PACKING_STRATEGIES)}]"
        )
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"max_len must be a positive integer, got {max_len!r}")
    max_len = int(max_len)
    sizes = _as_lengths(lengths)
    if strategy == "stream":
        return _stream(sizes, max_len), 0
    if strategy == "bfd_split":
        rows = _best_fit(_split_pieces(sizes, max_len), max_len)
        return _remainder_after_its_pieces(rows, max_len), 0
    dropped = sum(n - max_len for n in sizes if n > max_len)
    pieces = [(i, 0, min(n, max_len)) for i, n in enumerate(sizes) if n > 0]
    if strategy == "simple":
        return _next_fit(pieces, max_len), dropped
    return _best_fit(pieces, max_len), dropped


def apply_packing(
    docs: dict[str, list[np.ndarray]], rows: list[list[Piece]]
) -> dict[str, list[np.ndarray]]:
    """Concatenate each row's pieces for every key of `docs` (all keys aligned per document)."""
    if not docs:
        raise ValueError("docs has no keys: nothing to pack")
    keys = list(docs)
    num_docs = len(docs[keys[0]])
    for key in keys[1:]:
        if len(docs[key]) != num_docs:
            raise ValueError(
                f"docs[{key!r}] has {len(docs[key])} documents, docs[{keys[0]!r}] has {num_docs}"
            )
    doc_lengths = [len(arr) for arr in docs[keys[0]]]
    for key in keys[1:]:
        for i, arr in enumerate(docs[key]):
            if len(arr) != doc_lengths[i]:
                raise ValueError(
                    f"document {i}: docs[{key!r}] has {len(arr)} tokens, "
                    f"docs[{keys[0]!r}] has {doc_lengths[i]}; every key must be aligned"
                )
    for r, row in enumerate(rows):
        if not row:
            raise ValueError(f"row {r} is empty: every row needs at least one piece")
        for doc, start, end in row:
            if not 0 <= doc < num_docs or not 0 <= start < end <= doc_lengths[doc]:
                raise ValueError(
                    f"row {r}: piece {(doc, start, end)} is outside the documents "
                    f"({num_docs} documents; a piece needs 0 <= start < end <= length)"
                )
    return {
        key: [np.concatenate([docs[key][d][s:e] for d, s, e in row]) for row in rows]
        for key in keys
    }


def position_ids(row: list[Piece], mode: str) -> np.ndarray | None:
    """Position ids (int32) for one row; None for mode 'none'.

    doc_reset: a piece [s, e) gets s..e-1, so each document counts from 0 and a
    document split across rows continues where it stopped. continuous: 0..len-1.
    """
    if mode not in POSITION_IDS_MODES:
        raise ValueError(
            f"unknown position_ids mode {mode!r}: expected one of [{', '.join(POSITION_IDS_MODES)}]"
        )
    if mode == "none":
        return None
    if mode == "continuous":
        return np.arange(sum(e - s for _, s, e in row), dtype=np.int32)
    if not row:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate([np.arange(s, e, dtype=np.int32) for _, s, e in row])


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> list[int]:
    """Validate lengths as a flat list of non-negative integers."""
    arr = np.asarray(lengths)
    if arr.size == 0:
        return []
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(
            f"lengths must be a flat sequence of integers, got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.min() < 0:
        first = int(np.argmax(arr < 0))
        raise ValueError(f"lengths[{first}] is {int(arr[first])}: lengths must be >= 0")
    return arr.tolist()


def _split_pieces(sizes: list[int], max_len: int) -> list[Piece]:
    """Cut every document into max_len-sized pieces plus its remainder, in input order."""
    pieces: list[Piece] = []
    for i, n in enumerate(sizes):
        if n > max_len:
            pieces.extend((i, s, min(s + max_len, n)) for s in range(0, n, max_len))
        elif n > 0:
            pieces.append((i, 0, n))
    return pieces


def _remainder_after_its_pieces(rows: list[list[Piece]], max_len: int) -> list[list[Piece]]:
    """bfd_split's rows with the full rows of the document whose remainder opens the first
    other row moved just before it. Otherwise that remainder (positions k*max_len...) could
    follow another document's k-th full piece (positions ...k*max_len-1) and, positions going
    on by one across the row boundary, read as its continuation. Nowhere else can positions
    go on by one from one document to another: full rows start at 0 or continue their own
    document, and a remainder or short document never ends at a multiple of max_len."""
    first_other = next((i for i, row in enumerate(rows) if row[0][2] - row[0][1] < max_len), None)
    if first_other is None or rows[first_other][0][1] == 0:
        return rows
    doc = rows[first_other][0][0]
    full = rows[:first_other]
    return (
        [row for row in full if row[0][0] != doc]
        + [row for row in full if row[0][0] == doc]
        + rows[first_other:]
    )


def _stream(sizes: list[int], max_len: int) -> list[list[Piece]]:
    """Every document in order, cut wherever a row is full."""
    rows: list[list[Piece]] = []
    room = 0
    for i, n in enumerate(sizes):
        start = 0
        while start < n:
            if room == 0:
                rows.append([])
                room = max_len
            take = min(room, n - start)
            rows[-1].append((i, start, start + take))
            start += take
            room -= take
    return rows


def _next_fit(pieces: list[Piece], max_len: int) -> list[list[Piece]]:
    """Order-preserving greedy: append to the current row, open a new one when full."""
    rows: list[list[Piece]] = []
    used = max_len  # forces a first row
    for piece in pieces:
        size = piece[2] - piece[1]
        if used + size > max_len:
            rows.append([])
            used = 0
        rows[-1].append(piece)
        used += size
    return rows


def _best_fit(pieces: list[Piece], max_len: int) -> list[list[Piece]]:
    return [[pieces[i] for i in row] for row in best_fit([e - s for _, s, e in pieces], max_len)]


def best_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing in O(n log n): the positions of `sizes` in groups of at most
    `capacity`. Each size, largest first (ties by position), goes to the open group with
    the least room that fits it (ties: the earliest group), else to a new group. Groups in
    order of opening, positions in placement order. The one packer of both halves: the
    pipeline's bfd rows and the loader's PoolPackingBatcher.

    Sizes only shrink, so a group that fits the current size fits every later one: such
    groups wait in `fits` (min-heap on room); the others wait in `short` (max-heap on
    room) and move to `fits` once the sizes get small enough. The top of `fits` is then
    the best fit, and each group moves at most once per size.
    """
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: ties keep position order
    groups: list[list[int]] = []
    fits: list[tuple[int, int]] = []  # (room, group), room >= current size
    short: list[tuple[int, int]] = []  # (-room, group), room < current size
    for i in order:
        size = sizes[i]
        if size > capacity:
            raise ValueError(f"an item of {size} exceeds the capacity of {capacity}")
        while short and -short[0][0] >= size:
            neg_room, group = heapq.heappop(short)
            heapq.heappush(fits, (-neg_room, group))
        if fits:
            room, group = heapq.heappop(fits)
        else:
            room, group = capacity, len(groups)
            groups.append([])
        groups[group].append(i)
        room -= size
        heapq.heappush(fits, (room, group)) if room >= size else heapq.heappush(
            short, (-room, group)
        )
    return groups
