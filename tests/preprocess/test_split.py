"""The validation split: a fixed rule of each record (its text, or its file and line), so the
held-out records are the same under any worker count, engine, input order or place; the splits
are disjoint and cover every record once; each split folder is a dataset with its own ledger."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import QWEN

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest
from tokenmill.training.dataset_factory import DatasetFactory
from tokenmill.training.mmap_store import MmapStore

HERE = Path(__file__).resolve().parent
N = 60


def config(by: str = "document", fraction: float = 0.3, **out) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {
            "input": {"sections": [{"field": "text"}]},
            "preprocessing": {
                "packing_strategy": "none",
                "min_chars": 1,
                "batch_size": 4,
                "task_bytes": 800,
                "validation": {"fraction": fraction, "by": by, "seed": 3},
            },
            "output": {"storage_format": "jsonl", **out},
        }
    )


def texts(n: int = N) -> list[str]:
    return [f"Document {i}: the quick brown fox no. {i}" for i in range(n)]


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def split_texts(out: Path) -> dict[str, list[str]]:
    """Each split's records, decoded, in dataset order."""
    tokenizer = load_tokenizer(QWEN).tokenizer
    found: dict[str, list[str]] = {}
    for split in ("train", "validation"):
        found[split] = []
        for part in sorted((out / split).rglob("part_*.jsonl")):
            for line in part.read_text().splitlines():
                found[split].append(tokenizer.decode(json.loads(line)["sequence"]))
    return found


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def held_out(key: bytes, seed: int = 3, fraction: float = 0.3) -> bool:
    """The documented rule, written out: blake2b(seed, key) / 2**64 < fraction."""
    digest = hashlib.blake2b(key, digest_size=8, person=b"tokenmill-split")
    digest.update(seed.to_bytes(8, "little"))
    return int.from_bytes(digest.digest(), "big") / 2**64 < fraction


def run(cfg: PipelineConfig, inputs, out: Path, **kw):
    return Pipeline(cfg, inputs, out, QWEN, **kw).run()


@pytest.mark.parametrize("by", ["document", "record"])
def test_the_split_is_disjoint_covers_every_record_and_ignores_worker_counts(tmp_path, by):
    src = write(tmp_path / "data" / "in.jsonl", [{"text": t} for t in texts()])
    one = run(config(by), [src], tmp_path / "w1", workers=1)
    four = run(config(by), [src], tmp_path / "w4", workers=4)
    assert files_of(tmp_path / "w4") == files_of(tmp_path / "w1")
    found = split_texts(tmp_path / "w1")
    assert sorted(found["train"] + found["validation"]) == sorted(texts())  # each once
    if by == "document":
        keys = [json.dumps([t], separators=(",", ":")).encode() for t in texts()]
    else:
        keys = [
            json.dumps(["in.jsonl", line]).replace(" ", "").encode() for line in range(1, N + 1)
        ]
    expected = [t for t, key in zip(texts(), keys, strict=True) if held_out(key)]
    assert found["validation"] == expected and 0 < len(expected) < N
    for summary in (one, four):
        assert summary.domains["validation"]["records_read"] == len(expected)
        assert summary.domains["train"]["records_read"] == N - len(expected)
    split_summary = read_manifest(tmp_path / "w1" / "validation")["summary"]
    assert split_summary["records_written"] == len(expected)
    assert split_summary["tokens"] == one.domains["validation"]["tokens_written"]


def test_by_document_ignores_order_place_ids_and_white_space(tmp_path):
    rows = [{"id": i, "text": t} for i, t in enumerate(texts())]
    write(tmp_path / "a" / "in.jsonl", rows)
    run(config(), [tmp_path / "a" / "in.jsonl"], tmp_path / "out_a")
    shuffled = [{"id": 1000 + r["id"], "text": "  " + r["text"].replace(" ", "\t ")} for r in rows]
    random.Random(0).shuffle(shuffled)
    write(tmp_path / "b" / "other.jsonl", shuffled[:20])
    write(tmp_path / "b" / "more.jsonl", shuffled[20:])
    run(config(), [tmp_path / "b"], tmp_path / "out_b")
    a, b = split_texts(tmp_path / "out_a"), split_texts(tmp_path / "out_b")
    squeeze = lambda ts: sorted(" ".join(t.split()) for t in ts)  # noqa: E731
    assert squeeze(b["validation"]) == squeeze(a["validation"])
    assert squeeze(b["train"]) == squeeze(a["train"])


def test_by_record_names_files_below_the_input_root_so_a_moved_input_keeps_its_split(tmp_path):
    for place in ("here", "there/deeper"):
        write(tmp_path / place / "x" / "a.jsonl", [{"text": t} for t in texts()[:30]])
        write(tmp_path / place / "y" / "a.jsonl", [{"text": t} for t in texts()[30:]])
    run(config("record"), [tmp_path / "here"], tmp_path / "out1")
    run(config("record"), [tmp_path / "there" / "deeper"], tmp_path / "out2")
    assert files_of(tmp_path / "out1") == files_of(tmp_path / "out2")
    found = split_texts(tmp_path / "out1")
    key = lambda name, line: json.dumps([name, line]).replace(" ", "").encode()  # noqa: E731
    expected = [t for i, t in enumerate(texts()[:30]) if held_out(key("x/a.jsonl", i + 1))]
    expected += [t for i, t in enumerate(texts()[30:]) if held_out(key("y/a.jsonl", i + 1))]
    assert found["validation"] == expected


def test_domains_sit_under_the_splits_and_each_split_loads_alone(tmp_path):
    rows = [{"text": t, "lang": "ab"[i % 2]} for i, t in enumerate(texts())]
    rows.append({"text": "no domain here"})
    src = write(tmp_path / "in.jsonl", rows)
    cfg = config(domain_key="lang", storage_format="bin")
    summary = run(cfg, [src], tmp_path / "out", on_error="skip")
    out = tmp_path / "out"
    assert sorted(read_manifest(out)["domains"]) == [
        "train/a",
        "train/b",
        "validation/a",
        "validation/b",
    ]
    assert summary.domains[""]["dropped"] == {"bad_record": {"records": 1, "tokens": 0}}
    total = 0
    for split in ("train", "validation"):
        manifest = read_manifest(out / split)
        assert manifest["split"] == split and sorted(manifest["domains"]) == ["a", "b"]
        store = MmapStore(window_size=64).load(out / split)
        assert store.manifest["split"] == split
        parts = [MmapStore(window_size=64).load(out / split / d).num_rows for d in "ab"]
        assert sum(parts) == store.num_rows  # a split's domain loads on its own too
        records = manifest["summary"]["records_read"]
        assert records == sum(summary.domains[f"{split}/{d}"]["records_read"] for d in "ab")
        assert manifest["summary"]["tokens"] == sum(
            i["tokens"] for d in "ab" for i in manifest["domains"][d]
        )
        total += records
    assert total == N


@pytest.mark.parametrize("storage_format", ["bin", "jsonl"])
def test_loading_the_root_of_a_split_output_is_refused(tmp_path, storage_format):
    src = write(tmp_path / "in.jsonl", [{"text": t} for t in texts()])
    out = tmp_path / "out"
    run(config(storage_format=storage_format), [src], out)
    message = f"{out} holds the splits train and validation: load {out}/train or {out}/validation"
    with pytest.raises(ValueError, match=message):
        DatasetFactory.load("seq", out, window_size=64)
    for split in ("train", "validation"):
        assert len(DatasetFactory.load("seq", out / split, window_size=64)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("by", ["document", "record"])
def test_the_ray_engine_holds_out_the_same_records(tmp_path, ray_cluster, by):
    src = write(tmp_path / "data" / "in.jsonl", [{"text": t} for t in texts()])
    local = run(config(by), [src], tmp_path / "local", workers=1)
    ray = run(config(by), [src], tmp_path / "ray", workers=2, engine="ray")
    assert files_of(tmp_path / "ray") == files_of(tmp_path / "local")
    assert ray.domains == local.domains
    shutil.rmtree(tmp_path / "ray")
