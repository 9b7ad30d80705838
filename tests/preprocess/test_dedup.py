"""Exact-duplicate removal (`preprocessing.dedup: exact`): the key (normalized text, case
kept), the rule (the first in input order is kept, within and across files and tasks), and
whole runs: the shards of a run with duplicates are byte for byte those of a run on the
input with them removed by hand, on any worker count, on Ray too, and after a resume; the
duplicates are counted in the summary."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA, QWEN

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.dedup import dedup_plan, duplicate_positions, text_hash
from tokenmill.preprocess.engines.engine import LocalEngine
from tokenmill.preprocess.engines.tasks import plan_tasks, task_chunks
from tokenmill.preprocess.inputs.records import Record, read_records
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.runlog import Summary

C4 = [json.loads(line) for line in (DATA / "pretrain_c4_300.jsonl").read_text().splitlines()]


def config(train_type: str = "seq", **pre) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update({"batch_size": 4, "dedup": "exact", **pre})
    data["output"]["max_tokens_per_shard"] = 3_000
    return PipelineConfig.from_dict(data)


def key(data: dict, cfg: PipelineConfig | None = None, line: int = 1) -> int:
    return text_hash(Record("x.jsonl", line, data), cfg or config())


def write(path: Path, rows: list) -> Path:
    """Rows as JSONL: a dict as a record, a str as a line as it is (a bad one)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- the key -----------------------------------------------------------------------------------


def test_the_key_is_the_text_in_nfc_with_white_space_runs_made_one_and_case_kept():
    text = "Caf\u00e9 au lait,\tplease.  Two of them"
    same = [
        {"text": text},
        {"text": "  Cafe\u0301 au lait, please.\n\nTwo   of them \n"},  # NFD, other white space
        {"text": text, "id": 7, "url": "https://elsewhere"},  # fields the sections do not read
    ]
    assert len({key(d) for d in same}) == 1
    others = [{"text": text.lower()}, {"text": text + "."}, {"text": text.replace(" ", "")}]
    assert len({key(d) for d in same[:1] + others}) == 4


def test_a_chat_s_key_is_every_message_with_its_role_and_a_pair_s_its_three_texts():
    sft = config("sft")
    chat = [{"role": "user", "content": "Hi  there"}, {"role": "assistant", "content": "Hello"}]
    respaced = [{**chat[0], "content": "Hi there "}, chat[1]]
    swapped = [{**chat[0], "role": "system"}, chat[1]]
    assert key({"messages": chat}, sft) == key({"messages": respaced}, sft)
    assert key({"messages": chat}, sft) != key({"messages": swapped}, sft)
    assert key({"messages": chat}, sft) != key({"messages": chat[:1]}, sft)
    assert key({"messages": chat}, sft) == key({"conversations": chat}, sft)  # input.columns
    sharegpt = [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": " Hello"}]
    assert key({"conversations": sharegpt}, sft) == key({"messages": chat}, sft)  # same chat
    tool = {"name": "clock", "parameters": {"type": "object", "properties": {}}}
    with_tools = key({"messages": chat, "tools": [tool]}, sft)  # rendered by the template
    assert with_tools == key({"messages": chat, "tools": [tool], "id": 2}, sft)
    assert with_tools not in (
        key({"messages": chat}, sft),
        key({"messages": chat, "tools": []}, sft),
    )
    dpo = config("dpo")
    pair = {"prompt": chat[:1], "chosen": chat[1:], "rejected": [{**chat[1], "content": "No"}]}
    assert key(pair, dpo) == key({**pair, "id": 3}, dpo)
    for field in ("prompt", "chosen", "rejected"):
        changed = [{**pair[field][0], "content": "something else"}]
        assert key({**pair, field: changed}, dpo) != key(pair, dpo), field


def test_a_record_missing_or_empty_in_a_field_it_must_have_is_never_a_duplicate():
    assert key({"id": 1}, line=1) != key({"id": 1}, line=2)  # bad records, each reported
    assert key({"text": None}, line=1) != key({"text": None}, line=2)
    assert key({"text": ""}, line=1) != key({"text": ""}, line=2)  # empty: bad, each named
    dpo = config("dpo")  # its prompt is made from the pair when absent: not needed
    pair = {
        "chosen": [{"role": "user", "content": "a"}],
        "rejected": [{"role": "user", "content": "b"}],
    }
    assert key(pair, dpo, line=1) == key(pair, dpo, line=2)


# --- the rule ----------------------------------------------------------------------------------


def test_the_first_in_task_order_is_kept_and_every_later_copy_is_a_duplicate():
    hashes = [
        np.array(h, dtype=np.uint64) for h in ([5, 7, 5, 5], [7, 9], [], [9, 5, 1, 2**64 - 1])
    ]
    found = duplicate_positions(hashes)
    assert {t: p.tolist() for t, p in found.items()} == {0: [2, 3], 1: [0], 3: [0, 1]}
    assert duplicate_positions([]) == {}
    assert duplicate_positions([np.array([3, 4], dtype=np.uint64)]) == {}


def reference_duplicates(files: list[Path]) -> list[tuple[str, int]]:
    """(file, line) of every record whose text came before, by a plain reading of the files."""
    seen: set[str] = set()
    out = []
    for path in files:
        for record in read_records(path, lambda err: None):
            text = " ".join(unicodedata.normalize("NFC", record.data["text"]).split())
            if text in seen:
                out.append((path.name, record.line))
            seen.add(text)
    return out


def three_files(root: Path) -> tuple[list[Path], list[Path]]:
    """Three inputs with duplicates within and across them (respaced, NFD, under other ids),
    a bad line and a case change that are not; and the same inputs with the duplicates
    removed by hand."""
    root.mkdir(exist_ok=True)
    c4 = [dict(r) for r in C4[:18]]
    c4[14]["text"] += " Caf\u00e9."
    nfd = {"text": unicodedata.normalize("NFD", c4[14]["text"]), "id": "x"}
    respaced = {"text": "  " + c4[4]["text"].replace(" ", "   \n") + " "}
    upper = {"text": c4[8]["text"].upper()}
    rows = {
        "a.jsonl": (c4[0:6] + ["{not json"], [c4[2], respaced]),
        "b.jsonl": (c4[6:12], [c4[0], c4[7]]),
        "c.jsonl": (c4[12:18] + [upper], [c4[13], nfd, c4[9]]),
    }
    with_dups = [write(root / name, kept + dups) for name, (kept, dups) in rows.items()]
    without = root / "removed"
    without.mkdir(exist_ok=True)
    return with_dups, [write(without / name, kept) for name, (kept, _) in rows.items()]


def duplicates_set_aside(plans, positions) -> list[tuple[str, int]]:
    return [
        (Path(r.source).name, r.line)
        for plan in plans
        for chunk in task_chunks(plan, 4, "file", None, positions.get(plan.index))
        for r in chunk.duplicates
    ]


@pytest.mark.parametrize("workers", [1, 4])  # hashed here; in four spawned processes
def test_duplicates_within_and_across_files_and_tasks(tmp_path, workers):
    files, _ = three_files(tmp_path)
    one = tmp_path / "one.jsonl"  # one file cut into tasks: duplicates across its tasks
    one.write_text("".join(f.read_text() for f in files))
    cfg = config()
    for inputs, task_bytes in ((files, max(f.stat().st_size for f in files)), ([one], 4_000)):
        plans = plan_tasks(inputs, [f.stat().st_size for f in inputs], task_bytes)
        assert len(plans) >= 3
        positions = dedup_plan(LocalEngine(workers), plans, cfg)
        assert all(p.dtype == np.int64 and list(p) == sorted(p) for p in positions.values())
        found = duplicates_set_aside(plans, positions)
        assert found == reference_duplicates(inputs)
        assert len(found) == 7
    plans = plan_tasks(files, [f.stat().st_size for f in files], 10**9)
    assert {t: p.tolist() for t, p in dedup_plan(LocalEngine(1), plans, cfg).items()} == {
        0: [6, 7, 14, 15, 23, 24, 25]  # positions count records: the bad line is none
    }
    assert dedup_plan(LocalEngine(1), plans, config(dedup="none")) == {}


def test_a_task_s_chunks_are_those_of_its_input_without_the_duplicates(tmp_path):
    files, removed = three_files(tmp_path)
    plan = plan_tasks(files[:1], [10**6], 10**6)[0]
    chunks = list(task_chunks(plan, 4, "file", None, np.array([6, 7])))
    bare = list(task_chunks(plan_tasks(removed[:1], [10**6], 10**6)[0], 4, "file"))
    assert [[r.data for r in c.records] for c in chunks] == [
        [r.data for r in c.records] for c in bare
    ]
    assert [len(c.duplicates) for c in chunks] == [0, 2]  # where they were read
    assert [[e.line for e in c.read_errors] for c in chunks] == [[], [7]]


# --- whole runs --------------------------------------------------------------------------------


def shard_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def by_hand(
    tmp_path: Path, files: list[Path], removed: list[Path], cfg: PipelineConfig
) -> tuple[dict[str, bytes], Summary]:
    """The run on the input with its duplicates removed by hand, at the same paths (a record's
    file name is in its rejects); the same task plan, checked."""
    sizes = [f.stat().st_size for f in files]
    task_bytes = cfg.preprocessing.task_bytes
    assert len(plan_tasks(files, sizes, task_bytes)) == len(files)
    saved = [f.read_bytes() for f in files]
    for f, r in zip(files, removed, strict=True):
        f.write_bytes(r.read_bytes())
    assert len(plan_tasks(files, [f.stat().st_size for f in files], task_bytes)) == len(files)
    bare = config(dedup="none", task_bytes=task_bytes)
    summary = Pipeline(bare, files, tmp_path / "by_hand", QWEN, workers=1, on_error="skip").run()
    for f, data in zip(files, saved, strict=True):
        f.write_bytes(data)
    assert "duplicate" not in summary.dropped and summary.records_written == 19
    return shard_files(tmp_path / "by_hand"), summary


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_a_run_writes_the_bytes_of_its_input_with_the_duplicates_removed_by_hand(tmp_path, workers):
    files, removed = three_files(tmp_path / "in")
    cfg = config(task_bytes=max(f.stat().st_size for f in files))
    expected, bare = by_hand(tmp_path, files, removed, cfg)
    summary = Pipeline(cfg, files, tmp_path / "out", QWEN, workers=workers, on_error="skip").run()
    assert shard_files(tmp_path / "out") == expected
    assert any(name.endswith(".bin") for name in expected)
    assert summary.records_read == bare.records_read + 7
    assert (summary.records_written, summary.tokens) == (bare.records_written, bare.tokens)
    assert summary.dropped["duplicate"] == {"records": 7, "tokens": 0}
    assert summary.domains[""]["dropped"]["duplicate"] == {"records": 7, "tokens": 0}


def interrupted_after(tasks: int):
    """`run_tasks` that stops the run (as a kill would) after `tasks` tasks are done; the
    tasks each call was given noted in `calls`."""
    calls: list[list[int]] = []

    def wrap(real):
        def run_tasks(plans, *args, **kwargs):
            calls.append([p.index for p in plans])
            for n, record in enumerate(real(plans, *args, **kwargs), start=1):
                yield record
                if len(calls) == 1 and n == tasks:
                    raise KeyboardInterrupt

        return run_tasks

    return wrap, calls


def test_a_resumed_run_drops_the_same_records(tmp_path):
    files, removed = three_files(tmp_path / "in")
    cfg = config(task_bytes=max(f.stat().st_size for f in files))
    expected, _ = by_hand(tmp_path, files, removed, cfg)
    wrap, calls = interrupted_after(2)
    for attempt in range(2):
        run = Pipeline(cfg, files, tmp_path / "out", QWEN, workers=1, on_error="skip")
        run._engine.run_tasks = wrap(run._engine.run_tasks)  # type: ignore[method-assign]
        if attempt == 0:
            with pytest.raises(KeyboardInterrupt):
                run.run()
        else:
            summary = run.run()
    assert calls == [[0, 1, 2], [2]]  # the resumed run did the last task only
    assert shard_files(tmp_path / "out") == expected
    assert summary.dropped["duplicate"] == {"records": 7, "tokens": 0}


# --- on Ray ------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_the_ray_engine_drops_the_same_records_and_writes_the_same_bytes(
    tmp_path, ray_cluster, workers
):
    files, _ = three_files(tmp_path / "in")
    cfg = config(task_bytes=6_000)  # files cut into tasks: duplicates across tasks
    local = Pipeline(cfg, files, tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    ray = Pipeline(
        cfg, files, tmp_path / "ray", QWEN, workers=workers, on_error="skip", engine="ray"
    ).run()
    assert shard_files(tmp_path / "ray") == shard_files(tmp_path / "local")
    assert ray.dropped == local.dropped and local.dropped["duplicate"]["records"] == 7
    assert ray.records_written == local.records_written == 19
