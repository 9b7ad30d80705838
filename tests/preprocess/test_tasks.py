"""tasks.py: tasks planned from file sizes alone, byte ranges read back to exactly the records
of a whole read, and a task's records cut into chunks; no Ray needed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from helpers import ROOT
from hypothesis import given, settings
from hypothesis import strategies as st
from malformed import CASES

from tokenmill.preprocess.engines.tasks import Piece, TaskPlan, plan_tasks, task_chunks
from tokenmill.preprocess.inputs.records import read_jsonl_range, read_records

DATA = ROOT / "data"


def lines_of(src: Path) -> list[str]:
    return [line + "\n" for line in src.read_text().split("\n") if line]


def mixed_inputs(root: Path) -> list[Path]:
    """Every input format, with bad and blank lines, records split across row groups and frames."""
    chat = lines_of(DATA / "chat_sharegpt_1000.jsonl")
    root.mkdir()
    plain = chat[:9]
    plain[2] = "{not json\n"
    plain[5] = "\n"
    plain[7] = '{"messages": "hello"}\n'
    (root / "a.jsonl").write_text("".join(plain))
    (root / "b.jsonl.gz").write_bytes(
        gzip.compress("".join(chat[9:16] + ["[1]\n"]).encode(), mtime=0)
    )
    frames = [
        zstandard.ZstdCompressor().compress("".join(part).encode())
        for part in (chat[16:20], chat[20:25])
    ]
    (root / "c.jsonl.zst").write_bytes(b"".join(frames))
    (root / "d.json").write_text(json.dumps([json.loads(x) for x in chat[25:30]] + [7]))
    table = pa.Table.from_pylist([json.loads(x) for x in chat[30:41]])
    pq.write_table(table, root / "e.parquet", row_group_size=4)
    return [root / n for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.json", "e.parquet")]


def view(records, errors) -> tuple[list, list]:
    return (
        [(r.source, r.line, repr(r.data)) for r in records],  # repr: NaN == NaN
        [(str(e), e.reason, e.field) for e in errors],
    )


def whole(path: Path) -> tuple[list, list]:
    errors: list = []
    return view(list(read_records(path, errors.append)), errors)


def by_ranges(path: Path, cuts: list[int]) -> tuple[list, list]:
    errors: list = []
    records = []
    bounds = [0, *cuts, path.stat().st_size]
    for start, end in zip(bounds, bounds[1:], strict=False):
        records += read_jsonl_range(path, start, end, errors.append)
    return view(records, errors)


def test_the_plan_cuts_big_jsonl_files_by_bytes_and_joins_small_files():
    files = [Path(n) for n in ("a.jsonl", "b.jsonl", "c.jsonl.gz", "d.jsonl", "e.parquet")]
    plans = plan_tasks(files, [250, 40, 300, 30, 20], task_bytes=100)
    assert [[(p.path.name, p.file, p.start, p.end) for p in t.pieces] for t in plans] == [
        [("a.jsonl", 0, 0, 100)],
        [("a.jsonl", 0, 100, 200)],
        [("a.jsonl", 0, 200, 250), ("b.jsonl", 1, 0, None)],  # 50 + 40: one task
        [("c.jsonl.gz", 2, 0, None)],  # unsplittable: a task of its own, whatever its size
        [("d.jsonl", 3, 0, None), ("e.parquet", 4, 0, None)],
    ]
    assert [t.index for t in plans] == [0, 1, 2, 3, 4]
    assert len(plan_tasks([], [], 100)) == 1  # an empty input still ends in one (empty) task


def test_byte_ranges_give_the_records_and_errors_of_a_whole_read(tmp_path):
    files = mixed_inputs(tmp_path / "mixed")
    a = files[0]
    size = a.stat().st_size
    for cuts in ([1], [size // 2], [size - 1], list(range(1, size, 97)), list(range(1, size, 5))):
        assert by_ranges(a, cuts) == whole(a), cuts
    raw = a.read_bytes()
    at_line_start = [i + 1 for i, b in enumerate(raw[:-1]) if b == ord("\n")]
    assert by_ranges(a, at_line_start) == whole(a)  # a cut right at a line's first byte
    assert len(whole(a)[0]) == 7 and len(whole(a)[1]) == 1


@settings(max_examples=60, deadline=None)
@given(
    lines=st.lists(
        st.one_of(
            st.dictionaries(st.text(max_size=3), st.integers(), max_size=3).map(json.dumps),
            st.sampled_from(["", "  ", "{bad", "[1]", '"x"', "\r"]),
        ),
        max_size=25,
    ),
    end_newline=st.booleans(),
    bom=st.booleans(),
    data=st.data(),
)
def test_any_cut_of_any_jsonl_file_reads_each_record_once(
    tmp_path_factory, lines, end_newline, bom, data
):
    path = tmp_path_factory.mktemp("cut") / "x.jsonl"
    text = "\n".join(lines) + ("\n" if end_newline and lines else "")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    size = path.stat().st_size
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, size - 1)), max_size=6))))
    assert by_ranges(path, [c for c in cuts if c < size]) == whole(path)


def test_a_task_cuts_its_records_into_chunks_with_errors_where_they_were_met(tmp_path):
    files = mixed_inputs(tmp_path / "mixed")
    for i, case in enumerate(c for c in CASES if len(c.content) < 1 << 20):
        files.append(tmp_path / f"{i:02d}_{case.filename}")
        files[-1].write_bytes(case.content)
    plan = TaskPlan(3, [Piece(f, n) for n, f in enumerate(files)])
    records, errors = [], []
    for f in files:
        records += read_records(f, errors.append)
    for batch_size in (1, 3, 7, 500):
        chunks = list(task_chunks(plan, batch_size, "file"))
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert all(c.task == 3 for c in chunks) and [c.last for c in chunks][-1]
        assert sum(c.last for c in chunks) == 1
        assert all(len(c.records) == batch_size for c in chunks[:-1] if c.records)
        got = [r for c in chunks for r in c.records]
        assert view(got, [e for c in chunks for e in c.read_errors]) == view(records, errors)
    assert len(records) >= 100 and len(errors) >= 30


def test_max_items_is_a_budget_shared_by_the_tasks_of_a_run(tmp_path):
    files = mixed_inputs(tmp_path / "mixed")
    plans = [TaskPlan(i, [Piece(f, i)]) for i, f in enumerate(files)]
    budget = [12]
    chunks = [c for plan in plans for c in task_chunks(plan, 5, "file", budget)]
    assert sum(len(c.records) for c in chunks) == 12
    assert [c.task for c in chunks if c.last] == [0, 1, 2, 3, 4]  # every task still ends
