"""Pipeline: every training type's keys, worker-count invariance, atomic failure, skip accounting, resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from malformed import PIPELINE_CASES, PIPELINE_CONFIGS

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.filters import FILTER_REASONS
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest
from tokenmill.shards.reader import find_shards
from tokenmill.shards.verify import verify_dataset
from tokenmill.training.mmap_store import MmapStore

ROOT = ROOT
DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"
DEEPSEEK = DATA / "tokenizers" / "deepseek-v3"


def config(train_type: str, **pre) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update(pre.pop("preprocessing", {}))
    data["output"].update(pre.pop("output", {}))
    return PipelineConfig.from_dict(data)


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def lines_of(src: Path) -> list[str]:
    """Lines split on \\n only (the data holds U+2028, which str.splitlines would split on)."""
    return [line + "\n" for line in src.read_text().split("\n") if line]


def head(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(lines_of(src)[:n]))
    return dst


TYPES = {
    "seq": ("pretrain_c4_300.jsonl", ["sequence", "position_ids", "doc_lengths"]),
    "instruction": (
        "instruction_humaneval.jsonl",
        ["sequence", "loss_mask", "position_ids", "doc_lengths"],
    ),
    "sft": ("chat_sharegpt_1000.jsonl", ["sequence", "loss_mask", "position_ids", "doc_lengths"]),
    "dpo": ("dpo_en_300.jsonl", ["chosen", "chosen_mask", "rejected", "rejected_mask"]),
    "grpo": ("grpo_from_dpo_300.jsonl", ["prompts", "responses", "masks", "rewards"]),
}


@pytest.mark.parametrize("train_type", list(TYPES))
def test_every_training_type_writes_its_keys(tmp_path, train_type):
    name, keys = TYPES[train_type]
    src = head(DATA / name, tmp_path / name, 40)
    out = tmp_path / "out"
    summary = Pipeline(config(train_type), [src], out, QWEN, workers=1, on_error="skip").run()
    assert summary.records_read == 40
    assert summary.records_written + sum(summary.skipped.values()) == 40
    assert summary.records_written > 30
    assert summary.ledger().unbalanced() == []
    manifest = read_manifest(out)
    assert manifest["summary"]["tokens_read"] == summary.tokens_read > 0
    assert list(manifest["keys"]) == keys
    meta = json.loads((find_shards(out)[0] / "meta.json").read_text())
    assert list(meta) == keys
    assert all("offsets" in meta[k] for k in keys)
    assert verify_dataset(out) == []
    store = MmapStore()
    store.load(out)
    if train_type == "grpo":
        rec = store.fetch_row(0, ["prompts", "responses", "masks", "rewards"])
        raw = json.loads(lines_of(src)[0])
        assert len(rec["responses"]) == len(raw["responses"]) == len(rec["masks"])
        assert rec["rewards"].dtype.is_floating_point and rec["rewards"].tolist() == raw["rewards"]
        assert all(m.all() for m in rec["masks"])  # responses train, each ends with <|im_end|>
        assert all(int(r[-1]) == 151645 for r in rec["responses"])
    if train_type == "dpo":
        assert store.num_rows == summary.records_written


@pytest.mark.slow
def test_output_bytes_do_not_depend_on_worker_count(tmp_path):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 120)
    cfg = config(
        "sft",
        preprocessing={"batch_size": 16, "max_packed_len": 4096},
        output={"max_tokens_per_shard": 30_000},
    )
    outs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"w{workers}"
        Pipeline(cfg, [src], out, QWEN, workers=workers, on_error="skip").run()
        outs.append(files_of(out))
    assert len([k for k in outs[0] if k.endswith("meta.json")]) >= 3
    assert outs[0] == outs[1] == outs[2]


def test_inputs_given_as_urls_give_the_same_shards(tmp_path):
    import fsspec

    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 60)
    cfg = config("seq", preprocessing={"batch_size": 16}, output={"max_tokens_per_shard": 8_000})
    fsspec.filesystem("memory").pipe("/pipeline/c4.jsonl", src.read_bytes())
    Pipeline(cfg, [src], tmp_path / "path", QWEN, workers=1).run()
    # file:// on two threads, memory:// on one
    for url, workers in ((src.as_uri(), 2), ("memory://pipeline", 1)):
        out = tmp_path / url.split(":")[0]
        Pipeline(cfg, [url], out, QWEN, workers=workers).run()
        assert files_of(out) == files_of(tmp_path / "path")
        assert len(find_shards(out)) >= 3
        assert read_manifest(out)["inputs"] == [
            url if url.endswith(".jsonl") else f"{url}/c4.jsonl"
        ]


def test_an_input_changed_in_place_is_not_taken_for_the_finished_run(tmp_path):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 5)
    cfg = config("seq")
    first = Pipeline(cfg, [src], tmp_path / "out", QWEN, workers=1).run()
    again = Pipeline(cfg, [src], tmp_path / "out", QWEN, workers=1).run()  # same job: done
    assert again.records_read == first.records_read == 5
    text, before = src.read_text(), src.stat()
    src.write_text(text.replace("a", "b", 1))  # same size, other content
    os.utime(src, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # on a coarse-clock fs too
    assert len(src.read_text()) == len(text)
    with pytest.raises(FileExistsError, match="holds other data"):
        Pipeline(cfg, [src], tmp_path / "out", QWEN, workers=1).run()


def test_bad_record_stops_the_run_and_leaves_nothing_that_looks_complete(tmp_path):
    lines = lines_of(DATA / "chat_sharegpt_1000.jsonl")[:60]
    lines[50] = (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "gpt", "content": "x"}]}\n'
    )
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(lines))
    out = tmp_path / "out"
    cfg = config(
        "sft",
        preprocessing={"batch_size": 8, "max_seq_len": 8192},
        output={"max_tokens_per_shard": 5_000},
    )
    with pytest.raises(RecordError) as err:
        Pipeline(cfg, [src], out, QWEN, workers=2).run()
    assert str(err.value).startswith(f"{src}:51: messages[1].role:")
    assert find_shards(out) == [] and read_manifest(out) is None
    assert [p.name for p in out.iterdir()] == []


def test_skip_counts_and_lists_every_bad_record(tmp_path):
    lines = lines_of(DATA / "chat_sharegpt_1000.jsonl")[:30]
    lines[3] = "{not json\n"
    lines[7] = '{"messages": "hello"}\n'
    lines[9] = '{"id": 1}\n'
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(lines))
    out = tmp_path / "out"
    summary = Pipeline(config("sft"), [src], out, QWEN, workers=1, on_error="skip").run()
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in rejects if r["line"] in (4, 8, 10)] == [
        (4, "bad_json"),
        (8, "wrong_type"),
        (10, "missing_field"),
    ]
    assert len(rejects) == sum(summary.skipped.values())
    assert summary.records_written + len(rejects) == 30 == summary.records_read
    assert read_manifest(out)["summary"]["skipped"] == summary.skipped


def test_packing_truncation_and_position_ids(tmp_path):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 50)
    cfg = config(
        "seq",
        preprocessing={
            "max_seq_len": 100,
            "max_packed_len": 256,
            "packing_strategy": "bfd",
            "truncation_mode": "keep_end",
        },
    )
    out = tmp_path / "out"
    summary = Pipeline(cfg, [src], out, QWEN, workers=1).run()
    store = MmapStore()
    store.load(out)
    rows = [store.fetch_row(i, ["sequence", "position_ids"]) for i in range(store.num_rows)]
    assert all(len(r["sequence"]) <= 256 for r in rows)
    assert sum(len(r["sequence"]) for r in rows) == summary.tokens
    # doc_reset: every document restarts at 0 and no document is longer than max_seq_len
    pos = np.concatenate([r["position_ids"].numpy() for r in rows])
    starts = np.flatnonzero(pos == 0)
    assert len(starts) == summary.records_written
    assert np.diff(np.append(starts, len(pos))).max() <= 100
    # keep_end: each truncated document keeps its last token, the EOS
    eos = 151645  # <|im_end|>, Qwen2.5's eos_token
    seq = np.concatenate([r["sequence"].numpy() for r in rows])
    assert all(seq[s - 1] == eos for s in starts[1:])


def test_domains_and_shard_rolling(tmp_path):
    src = tmp_path / "mixed.jsonl"
    texts = [json.loads(x)["text"] for x in lines_of(DATA / "pretrain_c4_300.jsonl")[:40]]
    src.write_text(
        "".join(
            json.dumps({"text": t, "lang": "en" if i % 3 else "fr"}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    cfg = config(
        "seq",
        preprocessing={"packing_strategy": "none"},
        output={"domain_key": "lang", "max_tokens_per_shard": 2_000},
    )
    out = tmp_path / "out"
    Pipeline(cfg, [src], out, QWEN, workers=1).run()
    manifest = read_manifest(out)
    assert sorted(manifest["domains"]) == ["en", "fr"]
    assert len(manifest["domains"]["en"]) > 1
    for shard in manifest["domains"]["en"][:-1]:
        assert shard["tokens"] <= 2_000 or shard["records"] == 1
    records = sum(s["records"] for d in manifest["domains"].values() for s in d)
    assert records == 40


def test_jsonl_storage_format(tmp_path):
    src = head(DATA / "dpo_en_300.jsonl", tmp_path / "dpo.jsonl", 10)
    cfg = config("dpo", output={"storage_format": "jsonl"})
    out = tmp_path / "out"
    Pipeline(cfg, [src], out, QWEN, workers=1).run()
    lines = (out / "part_00000_000.jsonl").read_text().splitlines()
    assert len(lines) == 10
    first = json.loads(lines[0])
    assert sorted(first) == ["chosen", "chosen_mask", "rejected", "rejected_mask"]
    assert len(first["chosen"]) == len(first["chosen_mask"])


def test_max_items_and_min_chars(tmp_path):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 50)
    cfg = config(
        "seq", preprocessing={"max_items": 7, "min_chars": 10_000_000, "max_chars": 20_000_000}
    )
    summary = Pipeline(cfg, [src], tmp_path / "out", QWEN, workers=1).run()
    assert summary.records_read == 7 and summary.skipped == {"too_short": 7}


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.name)
def test_malformed_pipeline_cases(tmp_path, case):
    src = tmp_path / case.filename
    src.write_bytes(case.content)
    cfg = PipelineConfig.from_dict(PIPELINE_CONFIGS[case.train_type])
    out = tmp_path / "out"
    if case.outcome[0] == "ok":
        summary = Pipeline(cfg, [src], out, QWEN, workers=1).run()
        assert summary.records_written == case.outcome[1]
        return
    _, reason, where, field = case.outcome
    if reason in FILTER_REASONS:  # length filters are counted skips, never fatal
        summary = Pipeline(cfg, [src], out, QWEN, workers=1).run()
        assert summary.skipped == {reason: 1} and summary.first_errors[reason][0].startswith(
            f"{tmp_path}/{where}"
        )
        return
    with pytest.raises(RecordError) as err:
        Pipeline(cfg, [src], out, QWEN, workers=1).run()
    assert err.value.reason == reason and err.value.field == field
    assert str(err.value).startswith(f"{tmp_path}/{where}")
    assert find_shards(out) == []
    summary = Pipeline(cfg, [src], tmp_path / "skip", QWEN, workers=1, on_error="skip").run()
    assert summary.skipped.get(reason) == 1


@pytest.mark.slow
def test_killed_run_resumes_to_identical_bytes(tmp_path):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 400)
    cfg_path = tmp_path / "sft.json"
    data = config(
        "sft",
        preprocessing={"batch_size": 8, "task_bytes": src.stat().st_size // 6},
        output={"max_tokens_per_shard": 20_000},
    )
    cfg_path.write_text(data.model_dump_json())
    clean = tmp_path / "clean"
    Pipeline(data, [src], clean, QWEN, workers=1, on_error="skip").run()
    assert len({info["name"][:11] for info in read_manifest(clean)["domains"][""]}) >= 6
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "preprocess",
        str(src),
        "-o",
        str(out),
        "-c",
        str(cfg_path),
        "--tokenizer",
        str(QWEN),
        "--workers",
        "1",
        "--on-error",
        "skip",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    record = out / ".tokenmill-run" / "tasks" / "00001.json"
    while not record.exists() and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_manifest(out) is None and record.exists()
    mtime = (out / "shard_00000_000" / "sequence.bin").stat().st_mtime_ns
    # an input touched since the crash is another job: refused, and the message says why
    stamp = src.stat()
    os.utime(src, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))
    with pytest.raises(FileExistsError, match=rf"another job: {src} changed since \(bytes"):
        Pipeline(data, [src], out, QWEN, workers=1, on_error="skip").run()
    os.utime(src, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # back as it was: resumes
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        out / "shard_00000_000" / "sequence.bin"
    ).stat().st_mtime_ns == mtime  # a done task's shards are kept, not rewritten
    assert files_of(out) == files_of(clean)
    assert read_manifest(out)["summary"]["skipped"] == read_manifest(clean)["summary"]["skipped"]
    assert read_manifest(out)["domains"] == read_manifest(clean)["domains"]


def test_deepseek_records_start_with_one_masked_bos(tmp_path):
    src = head(DATA / "instruction_humaneval.jsonl", tmp_path / "inst.jsonl", 5)
    out = tmp_path / "out"
    Pipeline(
        config("instruction", preprocessing={"packing_strategy": "none"}),
        [src],
        out,
        DEEPSEEK,
        workers=1,
    ).run()
    store = MmapStore()
    store.load(out)
    for i in range(5):
        rec = store.fetch_row(i, ["sequence", "loss_mask"])
        assert int(rec["sequence"][0]) == 0 and int((rec["sequence"] == 0).sum()) == 1
        assert not bool(rec["loss_mask"][0]) and bool(rec["loss_mask"][-1])


def test_jsonl_output_with_domains_resumes_and_lists_domains_in_store_order(tmp_path):
    texts = [json.loads(x)["text"] for x in lines_of(DATA / "pretrain_c4_300.jsonl")[:60]]
    src = tmp_path / "mixed.jsonl"
    src.write_text(
        "".join(
            json.dumps({"text": t, "lang": "zz" if i % 2 else "aa"}) + "\n"
            for i, t in enumerate(texts)
        )
    )
    cfg = config(
        "seq",
        preprocessing={"packing_strategy": "none", "batch_size": 4},
        output={"domain_key": "lang", "max_tokens_per_shard": 3_000, "storage_format": "jsonl"},
    )
    clean = tmp_path / "clean"
    Pipeline(cfg, [src], clean, QWEN, workers=1).run()
    assert list(read_manifest(clean)["domains"]) == ["aa", "zz"]

    import tokenmill.shards.writer as shards

    out, calls = tmp_path / "out", {"n": 0}
    real_flush = shards.ShardWriter._flush

    def crash_on_fourth(self):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        real_flush(self)

    shards.ShardWriter._flush = crash_on_fourth
    try:
        with pytest.raises(KeyboardInterrupt):
            Pipeline(cfg, [src], out, QWEN, workers=1).run()
    finally:
        shards.ShardWriter._flush = real_flush
    assert read_manifest(out) is None and list(out.rglob("part_*.jsonl"))
    Pipeline(cfg, [src], out, QWEN, workers=1).run()
    assert files_of(out) == files_of(clean)
    assert read_manifest(out)["domains"] == read_manifest(clean)["domains"]


def test_filters_are_counted_not_fatal_even_under_raise(tmp_path):
    """Valid but unwanted records (too short, nothing left to train) are dropped and counted
    by reason with their file:line, whatever --on-error says; the ledger balances per domain."""
    long = "A question that is long enough to pass the character filter."
    records = [
        {"lang": "en", "messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "Yes."}]},
        {"lang": "en", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi"}]},
        {"lang": "fr", "messages": [{"role": "user", "content": long}]},
        {"lang": "fr", "messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "Oui."}]},
    ]  # fmt: skip
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = config("sft", output={"domain_key": "lang"})
    summary = Pipeline(cfg, [src], tmp_path / "out", QWEN, workers=1).run()  # on_error="raise"
    assert summary.records_written == 2
    assert summary.skipped == {"no_trained_tokens": 1, "too_short": 1}
    rejects = [
        json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()
    ]
    assert [(r["line"], r["reason"]) for r in rejects] == [
        (2, "too_short"),
        (3, "no_trained_tokens"),
    ]
    assert summary.ledger().unbalanced() == []
    assert set(summary.domains) == {"en", "fr"}
    for domain, reason in (("en", "too_short"), ("fr", "no_trained_tokens")):
        ledger = Ledger.from_dict(summary.domains[domain])
        assert ledger.unbalanced() == [] and list(ledger.dropped) == [reason]
        assert ledger.records_read == 2 and ledger.records_written == 1
    assert sum(d["tokens_read"] for d in summary.domains.values()) == summary.tokens_read
    assert "domain fr:" in summary.format() and "no_trained_tokens" in summary.format()


def test_overwrite_never_removes_what_tokenmill_did_not_write(tmp_path):
    """--overwrite replaces a tokenmill output only, and no output may hold an input."""
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "in.jsonl", 3)
    with pytest.raises(ValueError, match=f"{tmp_path} contains the input {src}"):
        Pipeline(config("sft"), [src], tmp_path, QWEN, workers=1, overwrite=True).run()
    assert src.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a tokenmill output"):
        Pipeline(config("sft"), [src], mine, QWEN, workers=1, overwrite=True).run()
    assert (mine / "notes.txt").read_text() == "keep me"
    out = tmp_path / "out"
    Pipeline(config("sft"), [src], out, QWEN, workers=1).run()
    Pipeline(
        config("sft", preprocessing={"min_chars": 0}), [src], out, QWEN, workers=1, overwrite=True
    ).run()
    assert read_manifest(out)["config"]["preprocessing"]["min_chars"] == 0


def test_a_run_killed_before_it_wrote_anything_starts_afresh(tmp_path):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "in.jsonl", 3)
    out = tmp_path / "out"
    (out / ".tokenmill-run").mkdir(parents=True)  # what a kill before the run id leaves
    summary = Pipeline(config("sft"), [src], out, QWEN, workers=1).run()
    assert summary.records_read == 3 and read_manifest(out) is not None


def test_values_and_domains_that_cannot_be_stored_are_named(tmp_path):
    grpo = {"prompt": [{"role": "user", "content": "Say hi."}], "responses": ["hi", "yo"]}
    src = tmp_path / "grpo.jsonl"
    src.write_text(json.dumps({**grpo, "rewards": [1e39, 0]}) + "\n")
    with pytest.raises(
        RecordError, match=r"grpo.jsonl:1: rewards\[0\]: 1e\+39 is beyond the range of float32"
    ):
        Pipeline(config("grpo"), [src], tmp_path / "g", QWEN, workers=1).run()
    for name in ("manifest.json", "rejects.jsonl", "web.tmp-1", "shard_00001", ".tokenmill-run"):
        src = tmp_path / "sft.jsonl"
        text = "A question that is long enough to pass the character filter."
        src.write_text(json.dumps({"lang": name, "messages": [
            {"role": "user", "content": text}, {"role": "assistant", "content": "Yes."}]}) + "\n")  # fmt: skip
        with pytest.raises(RecordError, match="lang: domain must be a short name"):
            Pipeline(
                config("sft", output={"domain_key": "lang"}), [src], tmp_path / "d", QWEN, workers=1
            ).run()


@pytest.mark.slow
def test_pool_workers_exit_when_their_parent_is_killed(tmp_path):
    """As the kernel's OOM killer would: SIGKILL the preprocessing parent; its pool workers
    (4 workers: 2 processes of 2 threads) are gone within seconds instead of holding their
    memory forever."""
    for i in range(6):
        (tmp_path / f"part{i}.jsonl").write_bytes((DATA / "chat_sharegpt_1000.jsonl").read_bytes())
    cmd = [sys.executable, "-m", "tokenmill", "preprocess", str(tmp_path), "-o", str(tmp_path / "out"),
           "--type", "sft", "--tokenizer", str(QWEN), "--workers", "4"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def children() -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
        return [int(pid) for pid in found.stdout.split()]

    deadline = time.time() + 60
    while len(children()) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    workers = children()
    assert len(workers) >= 2 and proc.poll() is None, (
        "the run ended before its workers could be seen"
    )
    time.sleep(1.0)  # the workers are set up and working
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 120  # a bound for a loaded machine; the loop ends early
    while any(os.path.exists(f"/proc/{pid}") for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"workers {alive} outlived their parent"


@pytest.mark.slow
def test_a_second_run_of_a_live_output_is_refused_naming_it_and_a_dead_runs_lock_is_taken_over(
    tmp_path,
):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 1000)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "preprocess", str(src), "-o", str(out), "--type",
           "sft", "--tokenizer", str(QWEN), "--workers", "1"]  # fmt: skip
    lock = tmp_path / ".out.tokenmill-lock"
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (lock.exists() and lock.read_text()) and time.time() < deadline:
        time.sleep(0.01)
    try:
        with pytest.raises(
            FileExistsError, match=rf"another run is writing this output \(pid {first.pid} on "
        ):
            Pipeline(config("sft"), [src], out, QWEN, workers=1).run()
    finally:
        os.kill(first.pid, signal.SIGKILL)  # as the OOM killer would: no clean-up
        first.wait()
    summary = Pipeline(config("sft"), [src], out, QWEN, workers=1).run()  # takes the lock over
    assert summary.records_read == 1000 and verify_dataset(out) == []


def test_rejects_are_listed_in_input_order(tmp_path):
    """Unreadable lines and records a config rejects, interleaved in one chunk and across two
    files, are listed in rejects.jsonl as they stand in the inputs."""
    good = json.dumps({"text": "a sentence long enough to keep " * 3})
    short = json.dumps({"text": "too short"})
    first = tmp_path / "a.jsonl"
    first.write_text("\n".join([good, short, "{not json", good, short, "{bad"]) + "\n")
    second = tmp_path / "b.jsonl"
    second.write_text("\n".join(["{bad", short, good]) + "\n")
    Pipeline(
        config("seq"), [first, second], tmp_path / "out", QWEN, workers=1, on_error="skip"
    ).run()
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").open()]
    assert [(Path(r["source"]).name, r["line"]) for r in rejects] == [
        ("a.jsonl", 2), ("a.jsonl", 3), ("a.jsonl", 5), ("a.jsonl", 6), ("b.jsonl", 1),
        ("b.jsonl", 2),
    ]  # fmt: skip
