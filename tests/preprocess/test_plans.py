"""plans.py: the chunks iter_chunks cuts, placed from per-file scans and read back; no Ray needed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import ROOT
from malformed import CASES

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines import plans
from tokenmill.preprocess.engines.chunks import iter_chunks
from tokenmill.preprocess.engines.plans import plan_chunks, read_chunk, scan_file

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


def chunk_view(chunk) -> tuple:
    return (
        chunk.index,
        [(r.source, r.line, repr(r.data)) for r in chunk.records],  # repr: NaN == NaN
        [(str(e), e.reason, e.field) for e in chunk.read_errors],
    )


def test_plans_cut_the_chunks_iter_chunks_cuts(tmp_path):
    files = mixed_inputs(tmp_path / "mixed")
    for i, case in enumerate(c for c in CASES if len(c.content) < 1 << 20):
        files.append(tmp_path / f"{i:02d}_{case.filename}")
        files[-1].write_bytes(case.content)
    scans = [scan_file(str(f)) for f in files]
    for batch_size in (1, 2, 3, 7, 500):
        for max_items in (None, 1, 9, 14, 40):
            cfg = PipelineConfig.from_dict(
                {
                    "preprocessing": {"batch_size": batch_size, "max_items": max_items},
                    "input": {"sections": [{"field": "text"}]},
                }
            )
            expected = [chunk_view(c) for c in iter_chunks(files, cfg, collect_errors=True)]
            got = [chunk_view(read_chunk(p)) for p in plan_chunks(scans, batch_size, max_items)]
            assert got == expected, (batch_size, max_items)
    assert sum(len(s.lines) for s in scans) >= 100 and sum(len(s.errors) for s in scans) >= 30


def test_work_units_read_each_unseekable_file_in_one_pass(tmp_path, monkeypatch):
    files = mixed_inputs(tmp_path / "mixed")
    scans = [scan_file(str(f)) for f in files]
    opened: list[str] = []
    open_bytes = plans.open_bytes

    def counting_open(path):
        opened.append(Path(path).name)
        return open_bytes(path)

    monkeypatch.setattr(plans, "open_bytes", counting_open)
    cfg = PipelineConfig.from_dict(
        {"preprocessing": {"batch_size": 2}, "input": {"sections": [{"field": "text"}]}}
    )
    expected = [chunk_view(c) for c in iter_chunks(files, cfg, collect_errors=True)]
    units = list(plans.work_units(plan_chunks(scans, 2, None)))
    got = []
    for unit in units:
        reader = plans.FileRangeReader()
        got += [chunk_view(read_chunk(plan, reader)) for plan in unit]
        reader.close()
    assert got == expected
    # b.jsonl.gz (7 records) and c.jsonl.zst (9 lines) span several chunks each, yet each is read
    # in one pass: a's last chunk ends in b, so that unit follows b; c starts on a chunk boundary
    assert {name: opened.count(name) for name in set(opened)} == {
        "a.jsonl": 4,  # seekable: one open (and seek) per chunk of its 7 records
        "b.jsonl.gz": 1,
        "c.jsonl.zst": 1,
    }


def test_work_units_scale_out_over_many_compressed_files(tmp_path, monkeypatch):
    chat = lines_of(DATA / "chat_sharegpt_1000.jsonl")
    files = []
    for i in range(12):  # 5 records each, chunks of 3: every file but a few ends mid-chunk
        files.append(tmp_path / f"{i:02d}.jsonl.gz")
        files[-1].write_bytes(gzip.compress("".join(chat[5 * i : 5 * i + 5]).encode(), mtime=0))
    scans = [scan_file(str(f)) for f in files]
    opened: list[str] = []
    open_bytes = plans.open_bytes
    monkeypatch.setattr(
        plans, "open_bytes", lambda path: opened.append(Path(path).name) or open_bytes(path)
    )
    units = list(plans.work_units(plan_chunks(scans, 3, None)))
    assert len(units) >= len(files)  # one unit per file at least, not one for the whole chain
    got = []
    for unit in units:
        reader = plans.FileRangeReader()
        got += [chunk_view(read_chunk(plan, reader)) for plan in unit]
        reader.close()
    cfg = PipelineConfig.from_dict(
        {"preprocessing": {"batch_size": 3}, "input": {"sections": [{"field": "text"}]}}
    )
    assert got == [chunk_view(c) for c in iter_chunks(files, cfg, collect_errors=True)]
    assert max(opened.count(f.name) for f in files) == 2  # its head in one unit, its rest in one


def test_a_file_changed_after_its_scan_raises_instead_of_losing_records(tmp_path):
    files = mixed_inputs(tmp_path / "mixed")
    scans = [scan_file(str(f)) for f in files]
    plans = list(plan_chunks(scans, 100, None))
    assert len(read_chunk(plans[0]).records) == 39
    (tmp_path / "mixed" / "d.json").write_text("[]")
    with pytest.raises(RuntimeError, match=r"d\.json: changed since it was scanned"):
        read_chunk(plans[0])
    files[3].write_text(json.dumps([{"messages": []}] * 5 + [7]))
    pq.write_table(pa.Table.from_pylist([{"messages": []}] * 3), files[4])
    with pytest.raises(RuntimeError, match=r"e\.parquet: changed since it was scanned"):
        read_chunk(plans[0])


def test_scan_places_every_record_of_a_compressed_file(tmp_path):
    (src,) = mixed_inputs(tmp_path / "mixed")[1:2]
    scan = scan_file(str(src))
    assert scan.lines.tolist() == [1, 2, 3, 4, 5, 6, 7]
    raw = gzip.decompress(src.read_bytes())
    starts = [0] + [i + 1 for i, b in enumerate(raw) if b == ord("\n")][:-1]
    assert scan.offsets.tolist() == starts[:7]
    assert [(before, err.reason, err.line) for before, err in scan.errors] == [(7, "not_object", 8)]


@pytest.mark.parametrize(
    ("chunks", "slots", "expected"),
    [(12, 1, 12), (32, 1, 32), (94, 1, 47), (94, 2, 47), (12, 4, 8), (300, 2, 50), (1000, 1, 63)],
)
def test_a_small_input_is_one_task_per_slot_a_large_one_tasks_of_at_most_the_cap(
    chunks, slots, expected
):
    """Each task's end lets a thread drain, so tasks are as few as the slots allow; the cap
    bounds what a retried task redoes; a task has at least TASK_CHUNKS (but the last)."""
    per_task = plans.task_chunks(chunks, slots)
    assert per_task == expected
    assert plans.TASK_CHUNKS <= per_task <= plans.MAX_TASK_CHUNKS
    if chunks <= slots * plans.MAX_TASK_CHUNKS:
        assert -(-chunks // per_task) <= slots
