"""Cleaning in the pipeline: the map and filter hooks run in the workers (threads, spawned
processes, Ray tasks), counted in the ledger; a hook's error names the record's file:line, the
hook and its own line; duplicates a pre-pass took out are counted, never tokenized.

The hooks live in this module: the workers import it as `test_cleaning` (tests/preprocess is
on sys.path here, in spawned processes, and on the Ray workers' PYTHONPATH)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import QWEN

from tokenmill.preprocess.chat.tokenizer import load_tokenizer
from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.engines.chunks import Chunk, process_chunk
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest

HERE = Path(__file__).resolve().parent


# --- the hooks ---------------------------------------------------------------------------------


def shout(record: dict) -> dict:
    """map: the text upper-cased; notes the process it ran in."""
    if record.get("trace"):
        Path(record["trace"], str(os.getpid())).touch()
    return {**record, "text": record["text"].upper()}


def even(record: dict) -> bool:
    """filter: records with an even n."""
    return record["n"] % 2 == 0


def fails_on_7(record: dict) -> dict:
    if record["n"] == 7:
        raise ValueError("no sevens")
    return record


def numpy_even(record: dict):
    """filter: a numpy comparison's verdict (numpy.bool_, not bool)."""
    return np.int64(record["n"]) % 2 == 0


def parses(record: dict) -> dict:
    """map: json.loads raises inside the json library on record 5."""
    return {**record, "parsed": json.loads("{" if record["n"] == 5 else "{}")}


def says_yes(record: dict) -> str:
    return "yes"


def gives_list(record: dict) -> list:
    return [record]


# --- helpers -----------------------------------------------------------------------------------


def config(**pre) -> PipelineConfig:
    return PipelineConfig.from_dict(
        {
            "input": {"sections": [{"field": "text"}]},
            "preprocessing": {"packing_strategy": "none", "min_chars": 1, "batch_size": 4, **pre},
            "output": {"storage_format": "jsonl"},
        }
    )


def records(n: int = 24, trace: Path | None = None) -> list[dict]:
    extra = {"trace": str(trace)} if trace is not None else {}
    return [
        {"n": i, "text": f"Record number {i} says hello " * (1 + i % 3), **extra} for i in range(n)
    ]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sequences(out: Path) -> list[list[int]]:
    """Every written record's ids, in dataset order."""
    rows = []
    for part in sorted(out.rglob("part_*.jsonl")):
        rows += [json.loads(line)["sequence"] for line in part.read_text().splitlines()]
    return rows


def run(cfg: PipelineConfig, src: Path, out: Path, **kw):
    return Pipeline(cfg, [src], out, QWEN, **kw).run()


# --- map and filter ----------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 4])  # threads of this process; two spawned processes
def test_map_then_filter_run_in_the_workers_and_the_filtered_are_counted(tmp_path, workers):
    trace = tmp_path / "trace"
    trace.mkdir()
    src = write(tmp_path / "in.jsonl", records(trace=trace))
    cfg = config(map="test_cleaning:shout", filter="test_cleaning:even")
    summary = run(cfg, src, tmp_path / "out", workers=workers)
    # the reference: the same records mapped and filtered here, run without hooks
    expected = [shout(r) for r in records() if r["n"] % 2 == 0]
    run(config(), write(tmp_path / "ref.jsonl", expected), tmp_path / "ref", workers=1)
    assert sequences(tmp_path / "out") == sequences(tmp_path / "ref")
    assert len(sequences(tmp_path / "out")) == 12
    assert summary.records_read == 24 and summary.records_written == 12
    assert summary.dropped == {"filtered": {"records": 12, "tokens": 0}}
    assert summary.skipped == {} and not (tmp_path / "out" / "rejects.jsonl").exists()
    assert summary.ledger().unbalanced() == []
    pids = {int(p.name) for p in trace.iterdir()}
    assert pids and (os.getpid() not in pids) == (workers > 2)


def test_a_hook_in_a_py_file_beside_the_config_runs_in_spawned_workers(tmp_path):
    """`hooks.py:keep` is named relative to the config file (as chat_template is), so a
    recipe folder needs no package on sys.path; spawned workers import the same file."""
    folder = tmp_path / "recipe"
    folder.mkdir()
    hooks = (  # a dataclass under postponed annotations needs its module in sys.modules
        "from __future__ import annotations\nimport dataclasses\n\n\n"
        "@dataclasses.dataclass\nclass Every:\n    n: int\n\n\n"
        "def keep(record):\n    return record['n'] % Every(3).n == 0\n"
    )
    (folder / "hooks.py").write_text(hooks)
    data = config().model_dump(mode="json")
    data["preprocessing"]["filter"] = "hooks.py:keep"
    (folder / "config.json").write_text(json.dumps(data))
    cfg = PipelineConfig.from_file(folder / "config.json")
    assert cfg.preprocessing.filter == f"{folder / 'hooks.py'}:keep"
    src = write(tmp_path / "in.jsonl", records())
    summary = run(cfg, src, tmp_path / "out", workers=4)
    assert summary.records_written == 8
    assert summary.dropped == {"filtered": {"records": 16, "tokens": 0}}
    first = read_manifest(tmp_path / "out")
    assert first["hooks"]["filter"].startswith(f"{folder / 'hooks.py'}:keep sha256:")
    (folder / "hooks.py").write_text(hooks.replace("Every(3)", "Every(4)"))  # edited code
    with pytest.raises(FileExistsError):  # another job, though the config reads the same
        run(cfg, src, tmp_path / "out", workers=1)
    assert run(cfg, src, tmp_path / "out", workers=1, overwrite=True).records_written == 6
    assert read_manifest(tmp_path / "out")["fingerprint"] != first["fingerprint"]
    data["preprocessing"]["filter"] = "missing.py:keep"
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"preprocessing.filter: cannot import .*missing.py:keep"):
        run(PipelineConfig.from_file(folder / "config.json"), src, tmp_path / "other", workers=1)


def test_a_numpy_verdict_filters_and_an_error_deep_in_a_library_names_the_hook_s_line(
    tmp_path,
):
    src = write(tmp_path / "in.jsonl", records())
    summary = run(config(filter="test_cleaning:numpy_even"), src, tmp_path / "out", workers=1)
    assert summary.dropped == {"filtered": {"records": 12, "tokens": 0}}
    with pytest.raises(RecordError) as caught:
        run(config(map="test_cleaning:parses"), src, tmp_path / "other", workers=1)
    line = parses.__code__.co_firstlineno + 2  # the hook's own line, not json's
    assert str(caught.value).endswith(f" at {HERE / 'test_cleaning.py'}:{line}")


def test_a_hook_that_raises_stops_the_run_naming_file_line_and_hook(tmp_path):
    src = write(tmp_path / "in.jsonl", records())
    with pytest.raises(RecordError) as caught:
        run(config(map="test_cleaning:fails_on_7"), src, tmp_path / "out", workers=1)
    text = str(caught.value)
    assert text.startswith(
        f"{src}:8: map hook test_cleaning:fails_on_7 raised ValueError: no sevens"
    )
    line = fails_on_7.__code__.co_firstlineno + 2  # the raise
    assert text.endswith(f" at {HERE / 'test_cleaning.py'}:{line}")
    assert read_manifest(tmp_path / "out") is None and sequences(tmp_path / "out") == []


def test_a_hook_that_raises_under_skip_is_a_bad_record_in_the_rejects(tmp_path):
    src = write(tmp_path / "in.jsonl", records())
    cfg = config(map="test_cleaning:fails_on_7", filter="test_cleaning:even")
    summary = run(cfg, src, tmp_path / "out", workers=1, on_error="skip")
    assert summary.records_read == 24 and summary.records_written == 12
    assert summary.dropped == {
        "bad_record": {"records": 1, "tokens": 0},
        "filtered": {"records": 11, "tokens": 0},
    }
    rejects = [
        json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    ]
    assert [(r["source"], r["line"], r["reason"]) for r in rejects] == [(str(src), 8, "bad_value")]
    assert rejects[0]["message"].startswith("map hook test_cleaning:fails_on_7 raised ValueError")


@pytest.mark.parametrize(
    ("hook", "message"),
    [
        (
            {"filter": "test_cleaning:says_yes"},
            "filter hook test_cleaning:says_yes returned str, expected True or False",
        ),
        (
            {"map": "test_cleaning:gives_list"},
            "map hook test_cleaning:gives_list returned list, expected a dict",
        ),
    ],
)
def test_a_hook_returning_the_wrong_type_is_named(tmp_path, hook, message):
    src = write(tmp_path / "in.jsonl", records(3))
    with pytest.raises(RecordError, match=f"^{src}:1: {message}$"):
        run(config(**hook), src, tmp_path / "out", workers=1)


def test_a_hook_that_does_not_import_is_a_config_error_before_any_output(tmp_path):
    src = write(tmp_path / "in.jsonl", records(3))
    for spec, why in [
        ("no_such_module_here:f", "ModuleNotFoundError"),
        ("test_cleaning:no_such_function", "AttributeError"),
    ]:
        with pytest.raises(
            ConfigError, match=f"^preprocessing.filter: cannot import {spec}: {why}"
        ):
            run(config(filter=spec), src, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"preprocessing.map: expected module:function"):
        config(map="test_cleaning.shout")


def test_new_keys_at_their_defaults_keep_the_config_s_fingerprint():
    cfg = config()
    assert "dedup" not in cfg.canonical_json() and "validation" not in cfg.canonical_json()
    assert cfg.dump()["preprocessing"].keys() == cfg.model_dump()["preprocessing"].keys() - {
        "map",
        "filter",
        "validation",
        "dedup",
    }
    assert config(dedup="exact").fingerprint() != cfg.fingerprint()
    assert PipelineConfig.from_dict(config(filter="test_cleaning:even").dump()) == config(
        filter="test_cleaning:even"
    )


# --- duplicates a pre-pass took out ------------------------------------------------------------


def test_duplicates_are_counted_per_domain_never_tokenized_nor_rejected():
    data = config().model_dump(mode="json")
    data["output"]["domain_key"] = "lang"
    cfg = PipelineConfig.from_dict(data)
    masker = RecordMasker(cfg, load_tokenizer(QWEN))
    kept = [Record("a.jsonl", 1, {"text": "first text", "lang": "en"})]
    kept.append(Record("a.jsonl", 3, {"text": "second text", "lang": "fr"}))
    dups = [
        Record("a.jsonl", 2, {"text": "first text", "lang": "en"}),
        Record("a.jsonl", 4, {"text": "first text", "lang": "en"}),
        Record("a.jsonl", 5, {"text": "second text", "lang": "fr"}),
        Record("a.jsonl", 6, {"text": "no domain"}),  # counted where no domain is
    ]
    result = process_chunk(Chunk(0, 0, kept, duplicates=dups, last=True), masker)
    assert result.records_read == 6 and result.records_written == 2 and result.errors == []
    assert {d: lg.as_dict() for d, lg in result.ledgers.items()} == {
        "": _ledger(read=1, written=0, tokens=0, duplicate=1),
        "en": _ledger(read=3, written=1, tokens=2, duplicate=2),
        "fr": _ledger(read=2, written=1, tokens=2, duplicate=1),
    }
    assert [d for d, _ in result.rows] == ["en", "fr"]


def _ledger(read: int, written: int, tokens: int, duplicate: int) -> dict:
    return {
        "records_read": read,
        "records_written": written,
        "tokens_read": tokens,
        "tokens_written": tokens,
        "dropped_tokens": 0,
        "dropped": {"duplicate": {"records": duplicate, "tokens": 0}},
    }


# --- on Ray ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hooks_run_in_ray_tasks_as_in_the_local_engine(tmp_path, ray_cluster):
    trace = tmp_path / "trace"
    trace.mkdir()
    src = write(tmp_path / "in.jsonl", records(trace=trace))
    cfg = config(map="test_cleaning:shout", filter="test_cleaning:even", task_bytes=600)
    local = run(cfg, src, tmp_path / "local", workers=1)
    before = {p.name for p in trace.iterdir()}
    ray = run(cfg, src, tmp_path / "ray", workers=2, engine="ray")
    assert sequences(tmp_path / "ray") == sequences(tmp_path / "local")
    assert len(sequences(tmp_path / "ray")) == 12
    assert ray.dropped == local.dropped == {"filtered": {"records": 12, "tokens": 0}}
    in_ray = {p.name for p in trace.iterdir()} - before
    assert in_ray and str(os.getpid()) not in in_ray
    with pytest.raises(RecordError, match=f"^{src}:8: map hook test_cleaning:fails_on_7 raised"):
        run(
            config(map="test_cleaning:fails_on_7", task_bytes=600),
            src,
            tmp_path / "r2",
            engine="ray",
        )
