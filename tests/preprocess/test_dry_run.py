"""Dry runs: the same tasks on the same engine, nothing written (no output folder, no lock, an
existing output left byte for byte), the same ledger printed as a real run's, and the written
rows' and documents' lengths counted by power of two."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import QWEN

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.task_output import length_bucket
from tokenmill.tools.cli import main


def records(n: int = 50) -> list[dict]:
    return [
        {"n": i, "lang": "ab"[i % 2], "text": f"Line {i} of the dry run test. " * (1 + i % 7)}
        for i in range(n)
    ]


def write_config(path: Path, **pre) -> Path:
    data = {
        "input": {"sections": [{"field": "text"}]},
        "preprocessing": {
            "batch_size": 8,
            "task_bytes": 2000,
            "min_chars": 60,
            "max_packed_len": 256,
            "filter": "test_cleaning:even",
            "validation": {"fraction": 0.25},
            **pre,
        },
        "output": {"domain_key": "lang", "storage_format": "jsonl"},
    }
    path.write_text(json.dumps(data))
    return path


def inputs(tmp_path: Path) -> Path:
    lines = [json.dumps(r) for r in records()]
    lines[5] = "{not json"
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    return src


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def ledger_lines(printed: str) -> list[str]:
    """The summary's lines that do not name the shards written or the time taken."""
    lines = printed.split("\nrows by length")[0].splitlines()
    return [line for line in lines if not line.startswith(("shards ", "seconds "))]


def test_a_dry_run_prints_the_real_run_s_ledger_and_writes_nothing(tmp_path, capsys):
    cfg, src = write_config(tmp_path / "cfg.json"), inputs(tmp_path)
    common = [str(src), "-c", str(cfg), "--tokenizer", str(QWEN), "--on-error", "skip"]
    assert main(["preprocess", *common, "-o", str(tmp_path / "dry"), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.json", "in.jsonl"]  # nor a lock
    assert main(["preprocess", *common, "-o", str(tmp_path / "real")]) == 0
    real = capsys.readouterr().out
    assert ledger_lines(dry) == ledger_lines(real)
    for line in ("split train:", "split validation:", "domain validation/a:", "    filtered"):
        assert any(printed.startswith(line) for printed in ledger_lines(dry)), line
    assert "shards                      0" in dry and "rows by length (tokens):" in dry
    assert "documents by length (tokens):" in dry and "rows by length" not in real


def test_a_dry_run_leaves_an_existing_output_exactly_as_it_was(tmp_path):
    cfg, src = PipelineConfig.from_file(write_config(tmp_path / "cfg.json")), inputs(tmp_path)
    out = tmp_path / "out"
    Pipeline(cfg, [src], out, QWEN, on_error="skip").run()
    again = write_config(tmp_path / "other.json", min_chars=10)  # another job
    before = tree(tmp_path)
    summary = Pipeline(
        PipelineConfig.from_file(again), [src], out, QWEN, on_error="skip", dry_run=True
    ).run()
    assert tree(tmp_path) == before
    assert summary.shards == 0 and summary.records_read == 50


def test_the_length_histograms_count_the_rows_and_documents_a_real_run_writes(tmp_path):
    cfg, src = PipelineConfig.from_file(write_config(tmp_path / "cfg.json")), inputs(tmp_path)
    dry = Pipeline(cfg, [src], tmp_path / "dry", QWEN, on_error="skip", workers=4, dry_run=True)
    summary = dry.run()
    Pipeline(cfg, [src], tmp_path / "real", QWEN, on_error="skip", workers=1).run()
    rows: dict[int, int] = {}
    docs: dict[int, int] = {}
    for part in (tmp_path / "real").rglob("part_*.jsonl"):
        for line in part.read_text().splitlines():
            row = json.loads(line)
            bucket = length_bucket(len(row["sequence"]))
            rows[bucket] = rows.get(bucket, 0) + 1
            for length in row["doc_lengths"]:
                docs[length_bucket(length)] = docs.get(length_bucket(length), 0) + 1
    assert dry.lengths == {"rows": rows, "documents": docs}
    assert sum(rows.values()) == summary.rows and sum(docs.values()) >= summary.records_written
    assert not (tmp_path / "dry").exists()
    assert [length_bucket(n) for n in (0, 1, 2, 3, 4, 5, 255, 256, 257)] == [
        0,
        1,
        2,
        4,
        4,
        8,
        256,
        256,
        512,
    ]
