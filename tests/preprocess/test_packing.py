"""Tests for tokenmill/preprocess/packing.py: golden rows, packing invariants, position ids."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.preprocess.packing import (
    PACKING_STRATEGIES,
    POSITION_IDS_MODES,
    _remainder_after_its_pieces,
    apply_packing,
    plan_packing,
    position_ids,
)

LENGTHS = [3, 7, 0, 5, 12, 2, 4]  # doc 2 is empty, doc 4 is over max_len=10

GOLDEN_ROWS = {
    "simple": (
        [[(0, 0, 3), (1, 0, 7)], [(3, 0, 5)], [(4, 0, 10)], [(5, 0, 2), (6, 0, 4)]],
        2,
    ),
    "bfd": (
        [[(4, 0, 10)], [(1, 0, 7), (0, 0, 3)], [(3, 0, 5), (6, 0, 4)], [(5, 0, 2)]],
        2,
    ),
    "bfd_split": (
        [[(4, 0, 10)], [(1, 0, 7), (0, 0, 3)], [(3, 0, 5), (6, 0, 4)], [(4, 10, 12), (5, 0, 2)]],
        0,
    ),
    # in order, every row full: documents 1 and 3 and 4 continue in the next row
    "stream": (
        [
            [(0, 0, 3), (1, 0, 7)],
            [(3, 0, 5), (4, 0, 5)],
            [(4, 5, 12), (5, 0, 2), (6, 0, 1)],
            [(6, 1, 4)],
        ],
        0,
    ),
}


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
def test_golden_rows(strategy: str) -> None:
    assert plan_packing(LENGTHS, 10, strategy) == GOLDEN_ROWS[strategy]
    assert plan_packing(np.array(LENGTHS, dtype=np.int64), 10, strategy) == GOLDEN_ROWS[strategy]


def test_best_fit_takes_the_smallest_room_not_the_first_row() -> None:
    # After 7 and 5+4 the rooms are [3, 1]: first fit would put the 1 in row 0.
    rows, _ = plan_packing([5, 7, 4, 1], 10, "bfd")
    assert rows == [[(1, 0, 7)], [(0, 0, 5), (2, 0, 4), (3, 0, 1)]]


def test_best_fit_equal_rooms_go_to_the_earliest_row() -> None:
    rows, _ = plan_packing([6, 6, 3, 3], 10, "bfd")
    assert rows == [[(0, 0, 6), (2, 0, 3)], [(1, 0, 6), (3, 0, 3)]]


def test_bfd_can_need_more_rows_than_simple() -> None:
    # Input order happens to tile perfectly; best-fit decreasing does not find it.
    lengths = [5, 3, 2, 4, 4, 2]
    assert plan_packing(lengths, 10, "simple") == (
        [[(0, 0, 5), (1, 0, 3), (2, 0, 2)], [(3, 0, 4), (4, 0, 4), (5, 0, 2)]],
        0,
    )
    assert plan_packing(lengths, 10, "bfd") == (
        [[(0, 0, 5), (3, 0, 4)], [(4, 0, 4), (1, 0, 3), (2, 0, 2)], [(5, 0, 2)]],
        0,
    )


def test_bfd_split_full_pieces_are_rows_of_their_own() -> None:
    rows, dropped = plan_packing([20, 21, 3], 10, "bfd_split")
    assert rows == [
        [(0, 0, 10)],
        [(0, 10, 20)],
        [(1, 0, 10)],
        [(1, 10, 20)],
        [(2, 0, 3), (1, 20, 21)],
    ]
    assert dropped == 0


@pytest.mark.parametrize("strategy", PACKING_STRATEGIES)
def test_zero_length_docs_get_no_rows(strategy: str) -> None:
    assert plan_packing([], 8, strategy) == ([], 0)
    assert plan_packing(np.array([], dtype=np.int32), 8, strategy) == ([], 0)
    assert plan_packing([0, 0], 8, strategy) == ([], 0)
    assert plan_packing([0, 4, 0], 8, strategy) == ([[(1, 0, 4)]], 0)


def test_unknown_strategy_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'greedy'.*\[simple, bfd, bfd_split, stream\]"):
        plan_packing([1, 2], 8, "greedy")


@pytest.mark.parametrize("max_len", [0, -1, 2.5, True, "8"])
def test_bad_max_len_raises(max_len: object) -> None:
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        plan_packing([1, 2], max_len, "bfd")  # type: ignore[arg-type]


def test_bad_lengths_raise() -> None:
    with pytest.raises(ValueError, match=r"lengths\[1\] is -3"):
        plan_packing([4, -3, 2], 8, "simple")
    with pytest.raises(ValueError, match="flat sequence of integers"):
        plan_packing([1.5, 2.0], 8, "simple")
    with pytest.raises(ValueError, match="flat sequence of integers"):
        plan_packing([[1, 2], [3, 4]], 8, "simple")  # type: ignore[list-item]


# ---------------------------------------------------------------- properties


@st.composite
def packing_inputs(draw: st.DrawFn) -> tuple[list[int], int]:
    """Small budgets and lengths up to 3x the budget: many ties, splits and truncations."""
    max_len = draw(st.integers(1, 24))
    lengths = draw(st.lists(st.integers(0, 3 * max_len), max_size=30))
    return lengths, max_len


def reference_best_fit(lengths: list[int], max_len: int, split: bool) -> list[list[tuple]]:
    """Best-fit decreasing by scanning every open row: the spec, written plainly."""
    pieces = []
    for i, n in enumerate(lengths):
        if split:
            pieces += [(i, s, min(s + max_len, n)) for s in range(0, n, max_len)]
        elif n > 0:
            pieces.append((i, 0, min(n, max_len)))
    pieces.sort(key=lambda p: p[2] - p[1], reverse=True)  # stable: ties keep input order
    rows: list[list[tuple]] = []
    rooms: list[int] = []
    for piece in pieces:
        size = piece[2] - piece[1]
        fitting = [(room, r) for r, room in enumerate(rooms) if room >= size]
        if fitting:
            _, r = min(fitting)
        else:
            r = len(rows)
            rows.append([])
            rooms.append(max_len)
        rows[r].append(piece)
        rooms[r] -= size
    return rows


@settings(deadline=None)
@given(packing_inputs(), st.sampled_from(PACKING_STRATEGIES))
def test_every_kept_token_is_placed_once_within_budget(
    inputs: tuple[list[int], int], strategy: str
) -> None:
    lengths, max_len = inputs
    rows, dropped = plan_packing(lengths, max_len, strategy)
    placed = Counter((d, t) for row in rows for d, s, e in row for t in range(s, e))
    splits = strategy in ("bfd_split", "stream")
    keep = (lambda n: n) if splits else (lambda n: min(n, max_len))
    expected = Counter((d, t) for d, n in enumerate(lengths) for t in range(keep(n)))
    assert placed == expected
    assert dropped == sum(n - keep(n) for n in lengths)
    for row in rows:
        assert row, "empty row"
        assert all(s < e for _, s, e in row)
        assert sum(e - s for _, s, e in row) <= max_len
    if strategy == "stream":  # the rows' concatenation is every document in order, rows full
        assert [(d, t) for row in rows for d, s, e in row for t in range(s, e)] == [
            (d, t) for d, n in enumerate(lengths) for t in range(n)
        ]
        assert all(sum(e - s for _, s, e in row) == max_len for row in rows[:-1])
    # Deterministic: the same input, as a list or an array, gives the same plan.
    assert plan_packing(lengths, max_len, strategy) == (rows, dropped)
    assert plan_packing(np.array(lengths, dtype=np.int32), max_len, strategy) == (rows, dropped)


@settings(deadline=None)
@given(packing_inputs(), st.sampled_from(["bfd", "bfd_split"]))
def test_best_fit_matches_the_plain_reference(inputs: tuple[list[int], int], strategy: str) -> None:
    lengths, max_len = inputs
    rows, _ = plan_packing(lengths, max_len, strategy)
    reference = reference_best_fit(lengths, max_len, split=strategy == "bfd_split")
    if strategy == "bfd_split":  # the same rows, one document's full rows moved (tested below)
        reference = _remainder_after_its_pieces(reference, max_len)
    assert rows == reference


@settings(deadline=None)
@given(packing_inputs(), st.sampled_from(["bfd", "bfd_split"]))
def test_best_fit_leaves_at_most_one_row_half_empty(
    inputs: tuple[list[int], int], strategy: str
) -> None:
    # Any second row that ended at most half full would have fit into the first.
    lengths, max_len = inputs
    rows, _ = plan_packing(lengths, max_len, strategy)
    fills = [sum(e - s for _, s, e in row) for row in rows]
    assert sum(2 * fill <= max_len for fill in fills) <= 1


@settings(deadline=None)
@given(packing_inputs())
def test_bfd_never_needs_more_rows_than_simple_on_the_same_order(
    inputs: tuple[list[int], int],
) -> None:
    # Best fit never opens more rows than next fit over the same order; bfd's order
    # is longest first (see test_bfd_can_need_more_rows_than_simple for input order).
    lengths, max_len = inputs
    longest_first = sorted(lengths, reverse=True)
    bfd_rows, _ = plan_packing(lengths, max_len, "bfd")
    simple_rows, _ = plan_packing(longest_first, max_len, "simple")
    assert len(bfd_rows) <= len(simple_rows)


@settings(deadline=None)
@given(packing_inputs())
def test_simple_keeps_input_order_and_fills_greedily(inputs: tuple[list[int], int]) -> None:
    lengths, max_len = inputs
    rows, _ = plan_packing(lengths, max_len, "simple")
    assert [d for row in rows for d, _, _ in row] == [d for d, n in enumerate(lengths) if n > 0]
    fills = [sum(e - s for _, s, e in row) for row in rows]
    for fill, next_row in zip(fills, rows[1:], strict=False):
        _, s, e = next_row[0]
        assert fill + (e - s) > max_len, "a new row was opened although the doc fit"


def make_docs(lengths: list[int]) -> dict[str, list[np.ndarray]]:
    """Per-document arrays whose values name their token: doc*1000 + position."""
    sequence = [np.arange(n, dtype=np.int32) + 1000 * d for d, n in enumerate(lengths)]
    return {
        "sequence": sequence,
        "loss_mask": [(seq % 3 == 0) for seq in sequence],
        "weights": [seq.astype(np.float32) / 2 for seq in sequence],
    }


@settings(deadline=None)
@given(packing_inputs(), st.sampled_from(PACKING_STRATEGIES))
def test_apply_packing_keeps_keys_aligned(inputs: tuple[list[int], int], strategy: str) -> None:
    lengths, max_len = inputs
    docs = make_docs(lengths)
    rows, _ = plan_packing(lengths, max_len, strategy)
    packed = apply_packing(docs, rows)
    assert list(packed) == ["sequence", "loss_mask", "weights"]
    for key, per_row in packed.items():
        assert len(per_row) == len(rows)
        for row, arr in zip(rows, per_row, strict=True):
            expected = np.concatenate([docs[key][d][s:e] for d, s, e in row])
            assert arr.dtype == docs[key][0].dtype
            np.testing.assert_array_equal(arr, expected)
    for r in range(len(rows)):
        assert (
            len(packed["sequence"][r]) == len(packed["loss_mask"][r]) == len(packed["weights"][r])
        )
        np.testing.assert_array_equal(packed["loss_mask"][r], packed["sequence"][r] % 3 == 0)


def test_apply_packing_golden() -> None:
    docs = make_docs(LENGTHS)
    packed = apply_packing(docs, GOLDEN_ROWS["bfd_split"][0])
    assert packed["sequence"][3].tolist() == [4010, 4011, 5000, 5001]
    assert packed["loss_mask"][3].tolist() == [False, True, False, True]
    assert packed["sequence"][1].tolist() == [1000 + t for t in range(7)] + [0, 1, 2]


def test_apply_packing_rejects_misaligned_docs() -> None:
    docs = make_docs([3, 4])
    docs["loss_mask"][1] = np.ones(5, dtype=bool)
    with pytest.raises(ValueError, match=r"document 1: docs\['loss_mask'\] has 5 tokens"):
        apply_packing(docs, [[(0, 0, 3), (1, 0, 4)]])
    docs = make_docs([3, 4])
    docs["weights"].pop()
    with pytest.raises(ValueError, match=r"docs\['weights'\] has 1 documents"):
        apply_packing(docs, [[(0, 0, 3)]])


def test_apply_packing_rejects_bad_rows() -> None:
    docs = make_docs([3, 4])
    with pytest.raises(ValueError, match=r"row 1: piece \(1, 2, 5\) is outside"):
        apply_packing(docs, [[(0, 0, 3)], [(1, 2, 5)]])
    with pytest.raises(ValueError, match=r"row 0: piece \(2, 0, 1\) is outside"):
        apply_packing(docs, [[(2, 0, 1)]])
    with pytest.raises(ValueError, match="row 0 is empty"):
        apply_packing(docs, [[]])
    with pytest.raises(ValueError, match="no keys"):
        apply_packing({}, [])


# ---------------------------------------------------------------- position ids


def test_position_ids_exact() -> None:
    row = [(2, 0, 3), (5, 10, 13), (7, 0, 1)]
    doc_reset = position_ids(row, "doc_reset")
    continuous = position_ids(row, "continuous")
    assert doc_reset is not None and continuous is not None
    assert doc_reset.dtype == np.int32 and continuous.dtype == np.int32
    assert doc_reset.tolist() == [0, 1, 2, 10, 11, 12, 0]
    assert continuous.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert position_ids(row, "none") is None
    assert position_ids([], "doc_reset").tolist() == []  # type: ignore[union-attr]
    assert position_ids([], "continuous").tolist() == []  # type: ignore[union-attr]


def test_position_ids_unknown_mode_lists_the_valid_ones() -> None:
    assert POSITION_IDS_MODES == ("none", "doc_reset", "continuous")
    with pytest.raises(ValueError, match=r"'reset'.*\[none, doc_reset, continuous\]"):
        position_ids([(0, 0, 2)], "reset")


def test_bfd_split_puts_a_remainder_right_after_its_own_full_pieces() -> None:
    # 13 and 10 tokens in rows of 8: doc 0's remainder opens the first non-full row, so doc
    # 0's full row comes last among the full ones; else doc 1's full row (positions 0..7)
    # would be followed by doc 0's remainder (positions 8..12), as if it went on
    rows, _ = plan_packing([13, 10], 8, "bfd_split")
    assert rows == [[(1, 0, 8)], [(0, 0, 8)], [(0, 8, 13), (1, 8, 10)]]


@settings(deadline=None)
@given(packing_inputs())
def test_bfd_split_positions_alone_tell_documents_apart(inputs: tuple[list[int], int]) -> None:
    # What PackedCollator relies on: across the stream of rows, wherever doc_reset positions
    # go on by one, the document is the same one (a split document may go on into the next row)
    lengths, max_len = inputs
    rows, _ = plan_packing(lengths, max_len, "bfd_split")
    docs = [d for row in rows for d, s, e in row for _ in range(s, e)]
    positions = [p for row in rows for p in position_ids(row, "doc_reset").tolist()]  # type: ignore[union-attr]
    for i in range(1, len(docs)):
        if positions[i] == positions[i - 1] + 1:
            assert docs[i] == docs[i - 1], (i, rows)


def test_doc_reset_continues_a_document_split_across_rows() -> None:
    rows, _ = plan_packing([25, 4], 10, "bfd_split")
    assert rows == [[(0, 0, 10)], [(0, 10, 20)], [(0, 20, 25), (1, 0, 4)]]
    per_row = [position_ids(row, "doc_reset").tolist() for row in rows]  # type: ignore[union-attr]
    assert per_row == [list(range(10)), list(range(10, 20)), [20, 21, 22, 23, 24, 0, 1, 2, 3]]


# ---------------------------------------------------------------- scale


@pytest.mark.timeout(60)  # a guard against quadratic behaviour, not a benchmark
@pytest.mark.slow
def test_200k_documents_pack_with_exact_row_counts() -> None:
    # Lengths 0..3000 spread evenly by a fixed stride; 63,445 docs exceed max_len.
    lengths = (np.arange(200_000, dtype=np.int64) * 7919) % 3001
    expected = {
        "simple": (167_811, 30_232_031),
        "bfd": (131_724, 30_232_031),
        "bfd_split": (146_485, 0),
    }
    for strategy, (num_rows, num_dropped) in expected.items():
        rows, dropped = plan_packing(lengths, 2048, strategy)
        fills = [sum(e - s for _, s, e in row) for row in rows]
        assert (len(rows), dropped) == (num_rows, num_dropped)
        assert max(fills) <= 2048 and min(fills) > 0
        assert sum(fills) + dropped == int(lengths.sum())
