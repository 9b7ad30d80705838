"""Ray engine: byte-identical output to the local engine, worker, write and driver crashes, no Ray."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT
from test_plans import lines_of, mixed_inputs

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines import plans
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.ray import engine as ray_engine
from tokenmill.preprocess.ray import head_start as ray_head_start
from tokenmill.preprocess.ray import merge as ray_merge
from tokenmill.preprocess.ray import results as ray_results
from tokenmill.preprocess.ray import writer as ray_writer
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest
from tokenmill.shards.reader import find_shards
from tokenmill.shards.writer import ShardSpec, ShardWriter

pytestmark = pytest.mark.slow  # Ray

ROOT = ROOT
DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"
TYPES = {
    "seq": "pretrain_c4_300.jsonl",
    "instruction": "instruction_humaneval.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
    "grpo": "grpo_from_dpo_300.jsonl",
}


def config(train_type: str, batch_size: int = 6, shard_tokens: int = 4_000) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"]["batch_size"] = batch_size
    data["output"]["max_tokens_per_shard"] = shard_tokens
    return PipelineConfig.from_dict(data)


def head(src: Path, dst: Path, n: int) -> Path:
    dst.write_text("".join(lines_of(src)[:n]))
    return dst


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def assert_same_dataset(out: Path, reference: Path) -> None:
    files = files_of(out)
    assert files == files_of(reference)
    assert sum(name.endswith("meta.json") for name in files) >= 2
    manifest, expected = read_manifest(out), read_manifest(reference)
    assert manifest["fingerprint"] == expected["fingerprint"]
    assert manifest["domains"] == expected["domains"]
    for key in ("records_read", "records_written", "skipped", "rows", "tokens", "trained_tokens"):
        assert manifest["summary"][key] == expected["summary"][key], key


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [
        (2, None, (1, 1.0)),
        (2, 2, (1, 1.0)),
        (2, 8, (4, 0.25)),
        (16, 64, (32, 0.46)),
        (16, None, (8, 1.87)),
        (1, None, (1, 0.5)),
        (96, 8, (4, 2.0)),
    ],
)
def test_the_task_pool_always_leaves_a_cpu_for_the_shard_writes(cpus, workers, expected):
    """Workers are threads, two to a task; a task's share is at most its two CPUs."""
    size, share = ray_results.pool_size(cpus, workers)
    assert (size, share) == expected
    assert cpus - size * share >= min(1.0, cpus / 2) - 1e-9
    with pytest.raises(ValueError, match="workers=300 is more than a Ray cluster of 2 CPUs"):
        ray_results.pool_size(2, 300)


def test_without_ray_the_message_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 5)
    with pytest.raises(ImportError, match=r"pip install 'tokenmill\[ray\]'"):
        Pipeline(config("seq"), [src], tmp_path / "out", QWEN, engine="ray").run()


# ---- on a Ray cluster ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture
def write_tasks(monkeypatch):
    """The shards written by Ray tasks, as on a cluster of several nodes (this one has one, where
    the driver writes them: `ray_engine.one_node`)."""
    monkeypatch.setattr(ray_engine, "one_node", lambda ray: False)


def test_on_one_node_the_driver_writes_the_rows_as_they_come(ray_address):
    engine = ray_engine.RayEngine(workers=2, address=None)
    with engine.session():
        assert engine.rows_here
        writer = engine.writer(ShardSpec(Path("unused"), {"input_ids": "int32"}, "input_ids", 10))
        assert isinstance(writer, ShardWriter)


@pytest.mark.parametrize(
    ("train_type", "workers", "writes"),
    [
        ("seq", 2, "driver"),
        ("seq", 2, "tasks"),
        ("instruction", 1, "tasks"),
        ("sft", 2, "driver"),
        ("dpo", 2, "tasks"),
        ("grpo", 1, "driver"),
        ("grpo", 1, "tasks"),
    ],
)
def test_every_training_type_matches_the_local_engine(
    tmp_path, ray_address, monkeypatch, train_type, workers, writes
):
    """Each type on both write paths: the driver's ShardWriter (one node), Ray write tasks."""
    monkeypatch.setattr(ray_engine, "one_node", lambda ray: writes == "driver")
    src = head(DATA / TYPES[train_type], tmp_path / TYPES[train_type], 40)
    cfg = config(train_type)
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(
        cfg, [src], tmp_path / "ray", QWEN, workers=workers, on_error="skip", engine="ray"
    ).run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")


def noted_runs(
    tmp_path: Path, monkeypatch, pool_waits: bool, pool_pause: float = 0.0
) -> tuple[Path, Path, Path]:
    """Ray Data's tasks and the driver's head start, each noting the chunks it yields in a
    folder of its own ("pool", "driver"); the pool's tasks wait until the driver's head start
    has ended (`pool_waits`), else the driver waits until the pool has yielded a chunk; the
    pool pauses `pool_pause` seconds after each chunk it yields. The third path is the file
    "driver-done" that the driver touches at the end of its head start."""
    pool, driver, driver_done = tmp_path / "pool", tmp_path / "driver", tmp_path / "driver-done"
    pool.mkdir()
    driver.mkdir()
    process_units, on_driver = ray_results.process_units, ray_results.head_start

    def noting(batch, *args):  # defined here, so Ray ships it by value to its workers
        deadline = time.time() + 60
        while pool_waits and not driver_done.exists() and time.time() < deadline:
            time.sleep(0.01)
        for out in process_units(batch, *args):
            (pool / str(int(out["index"][0]))).touch()
            yield out
            time.sleep(pool_pause)

    def driver_noting(*args):
        deadline = time.time() + 60
        while not pool_waits and not any(pool.iterdir()) and time.time() < deadline:
            time.sleep(0.01)
        for result in on_driver(*args):
            (driver / str(result.index)).touch()
            yield result
        driver_done.touch()

    monkeypatch.setattr(ray_results, "process_units", noting)
    monkeypatch.setattr(ray_results, "head_start", driver_noting)
    return pool, driver, driver_done


def indices(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir())


@pytest.mark.parametrize("train_type", ["sft", "dpo"])
def test_the_driver_works_the_first_task_while_it_is_held_back(
    tmp_path, ray_address, monkeypatch, train_type
):
    """20 chunks, in tasks of TASK_CHUNKS: while Ray Data starts its first task (here: holds
    it back), the driver takes that task's chunks one by one, claiming each; the task finds
    them all claimed and yields nothing; the pool's other tasks take the rest. The output is
    the local engine's."""
    monkeypatch.setattr(plans, "MAX_TASK_CHUNKS", plans.TASK_CHUNKS)
    src = head(DATA / TYPES[train_type], tmp_path / TYPES[train_type], 40)
    pool, driver, _ = noted_runs(tmp_path, monkeypatch, pool_waits=True)
    cfg = config(train_type, batch_size=2)
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    assert indices(driver) == list(range(plans.TASK_CHUNKS))
    assert indices(pool) == list(range(plans.TASK_CHUNKS, 20))
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    kv = ray_head_start.claims_kv()
    assert kv._internal_kv_list("tokenmill-", namespace=ray_head_start.CLAIMS) == []  # deleted


def test_the_driver_and_the_first_task_share_its_chunks_to_the_end(
    tmp_path, ray_address, monkeypatch
):
    """The driver, held back until the first task has yielded a chunk (so the task has chunk
    0), then claims chunks as its thread comes free, beside the task (which here pauses after
    each chunk): it works on after the task's start, each chunk is done once, by one side, and
    the output is the local engine's."""
    src = head(DATA / TYPES["sft"], tmp_path / TYPES["sft"], 40)
    pool, driver, driver_done = noted_runs(tmp_path, monkeypatch, False, pool_pause=0.2)
    cfg = config("sft", batch_size=2)
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    assert driver_done.exists()
    done_by_pool, done_by_driver = indices(pool), indices(driver)
    assert done_by_pool[0] == 0 and done_by_driver
    assert sorted(done_by_pool + done_by_driver) == list(range(20))
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")


def scan_after_chunk_0(monkeypatch, before_scan=lambda: None) -> list[bool]:
    """The scan (on the driver's pull thread) held back until the driver's head start has done
    chunk 0, then `before_scan()`; the list notes whether chunk 0 came first (False: the scan
    waited 60 s for it in vain)."""
    done, seen = threading.Event(), []
    head_start, scans = ray_results.head_start, ray_results._scans

    def noting(*args):
        for result in head_start(*args):
            done.set()
            yield result

    def held(*args):
        seen.append(done.wait(60))
        before_scan()
        yield from scans(*args)

    monkeypatch.setattr(ray_results, "head_start", noting)
    monkeypatch.setattr(ray_results, "_scans", held)
    return seen


def test_the_driver_works_chunk_0_before_the_scan_is_done(tmp_path, ray_address, monkeypatch):
    """A run from its start does not wait for the scan: the driver reads chunk 0 as the local
    engine does and works it while the scan runs; the output is the local engine's."""
    src = head(DATA / TYPES["sft"], tmp_path / TYPES["sft"], 40)
    seen = scan_after_chunk_0(monkeypatch)
    cfg = config("sft", batch_size=2)
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    assert seen == [True]
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")


def test_a_file_changed_before_its_scan_stops_the_run(tmp_path, ray_address, monkeypatch):
    """Chunk 0, read before the scan, must be the chunk the scan plans: a line added at the
    top after chunk 0 was read moves every record, and the run stops before any output."""
    src = head(DATA / TYPES["sft"], tmp_path / TYPES["sft"], 40)
    scan_after_chunk_0(monkeypatch, lambda: src.write_bytes(b"\n" + src.read_bytes()))
    cfg = config("sft", batch_size=2)
    out = tmp_path / "ray"
    with pytest.raises(
        RuntimeError, match=rf"^{re.escape(str(src))}: changed while it was scanned \(chunk 0,"
    ):
        Pipeline(cfg, [src], out, QWEN, workers=2, on_error="skip", engine="ray").run()
    assert find_shards(out) == [] and read_manifest(out) is None


def test_a_claim_is_its_owners_again_and_no_one_elses(ray_address):
    """A task that Ray runs again (its worker died) claims its chunks again: they are still
    the pool's; a chunk the driver has is not."""
    claims = "tokenmill-test-claims-"
    assert ray_head_start.claim(claims, 0, "driver") and ray_head_start.claim(claims, 0, "driver")
    assert not ray_head_start.claim(claims, 0, "pool")
    assert ray_head_start.claim(claims, 1, "pool") and ray_head_start.claim(claims, 1, "pool")
    assert not ray_head_start.claim(claims, 1, "driver")
    ray_head_start.claims_kv()._internal_kv_del(
        claims, del_by_prefix=True, namespace=ray_head_start.CLAIMS
    )


def test_every_input_format_and_bad_records_match_the_local_engine(tmp_path, ray_address):
    files = mixed_inputs(tmp_path / "mixed")
    cfg = config("sft", batch_size=4, shard_tokens=3_000)
    local = Pipeline(cfg, files, tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, files, tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    rejects = [json.loads(r) for r in (tmp_path / "ray" / "rejects.jsonl").read_text().splitlines()]
    assert [(Path(r["source"]).name, r["line"], r["reason"]) for r in rejects] == [
        ("a.jsonl", 3, "bad_json"),
        ("a.jsonl", 8, "wrong_type"),
        ("b.jsonl.gz", 8, "not_object"),
        ("d.json", 6, "not_object"),
    ]  # c.jsonl.zst's long first turns give way to their later turns (latest_turns)
    assert (local.records_read, local.records_written) == (42, 38)
    assert local.ledger().unbalanced() == [] and local.dropped["truncated"]["records"] == 9

    with pytest.raises(RecordError, match=r"a\.jsonl:3: invalid JSON"):
        Pipeline(cfg, files, tmp_path / "raise", QWEN, workers=2, engine="ray").run()
    assert find_shards(tmp_path / "raise") == [] and read_manifest(tmp_path / "raise") is None


def test_text_files_read_per_line_match_the_local_engine(tmp_path, ray_address):
    """input.text_unit reaches the scan and the tasks' readers: .txt lines are records there too."""
    folder = tmp_path / "texts"
    folder.mkdir()
    plays = [
        json.loads(line)["text"] for line in lines_of(ROOT / "data" / "pretrain_shakespeare.jsonl")
    ]
    for n, play in enumerate(plays[:3]):
        (folder / f"play_{n}.txt").write_text(play[:20_000])
    data = config("seq", batch_size=40, shard_tokens=3_000).model_dump(mode="json")
    data["input"]["text_unit"] = "line"
    data["preprocessing"]["min_chars"] = 1
    cfg = PipelineConfig.from_dict(data)
    local = Pipeline(cfg, [folder], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, [folder], tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    assert local.records_read > 3 * 100


def test_inputs_given_as_urls_match_the_local_engine_on_paths(tmp_path, ray_address):
    files = mixed_inputs(tmp_path / "mixed")
    cfg = config("sft", batch_size=4, shard_tokens=3_000)
    Pipeline(cfg, files, tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    urls = [f.as_uri() for f in files]  # read through fsspec, as s3:// or gs:// would be
    Pipeline(cfg, urls, tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    rejects = (tmp_path / "ray" / "rejects.jsonl").read_text()
    for f, url in zip(files, urls):
        rejects = rejects.replace(url, str(f))
    assert rejects == (tmp_path / "local" / "rejects.jsonl").read_text()
    (tmp_path / "ray" / "rejects.jsonl").write_text(rejects)
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    assert read_manifest(tmp_path / "ray")["inputs"] == urls


def test_a_killed_worker_is_replaced_and_no_record_is_lost_or_doubled(
    tmp_path, ray_address, monkeypatch
):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 40)
    marker = tmp_path / "crashed-once"

    process_units = ray_results.process_units
    crash_at = plans.TASK_CHUNKS + 1  # the second chunk of the second task: no driver's

    def crash_once(batch, *args):  # defined here, so Ray ships it by value to its workers
        for out in process_units(batch, *args):
            if int(out["index"][0]) == crash_at and not marker.exists():
                marker.touch()
                os._exit(1)  # the task's process dies with a chunk done, not yet handed on
            yield out

    monkeypatch.setattr(ray_results, "process_units", crash_once)
    monkeypatch.setattr(plans, "MAX_TASK_CHUNKS", plans.TASK_CHUNKS)
    cfg = config("seq", batch_size=2)  # 20 chunks, in tasks of 8, 8 and 4
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=1, on_error="skip", engine="ray").run()
    assert marker.exists()
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    assert read_manifest(tmp_path / "ray")["summary"]["records_read"] == 40


def test_a_killed_shard_write_is_retried_and_leaves_no_orphan(
    tmp_path, ray_address, monkeypatch, write_tasks
):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 40)
    marker = tmp_path / "crashed-once"
    write_rows = ray_writer.write_rows

    def crash_once(spec, *args):  # defined here: Ray ships it by value to workers
        tmp, info = write_rows(spec, *args)
        if spec.first_index == 1 and not marker.exists():
            marker.touch()
            os._exit(1)  # the task's process dies with its temp shard written, not yet published
        return tmp, info

    monkeypatch.setattr(ray_writer, "write_rows", crash_once)
    cfg = config("seq")
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=1, on_error="skip", engine="ray").run()
    assert marker.exists()
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")  # also: no temp folder left over


def test_driver_killed_then_resumed(tmp_path, ray_address):
    # enough work that the run is still going when its first shard is published
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 600)
    cfg = config("sft", batch_size=8, shard_tokens=10_000)
    cfg_path = tmp_path / "sft.json"
    cfg_path.write_text(cfg.model_dump_json())
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
        "--engine",
        "ray",
        "--ray-address",
        ray_address,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "shard_00000").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_manifest(out) is None and (out / "shard_00000").exists()
    mtime = (out / "shard_00000" / "sequence.bin").stat().st_mtime_ns
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (
        out / "shard_00000" / "sequence.bin"
    ).stat().st_mtime_ns == mtime  # reused, not rewritten
    Pipeline(cfg, [src], tmp_path / "clean", QWEN, workers=1, on_error="skip").run()
    assert_same_dataset(out, tmp_path / "clean")


def test_results_are_pulled_at_most_two_ahead_and_stop_when_the_run_stops():
    """The driver's pull of Ray Data's results keeps Ray Data's backpressure (a slow writer
    holds the pool back) and ends, closing Ray Data's iterator, once the run is closed."""
    drawn, closed = [], []

    def source():
        try:
            for i in range(100):
                drawn.append(i)
                yield i
        finally:
            closed.append(True)

    items, close = ray_merge.pulled(source)
    assert [next(items) for _ in range(3)] == [(0, 0), (0, 1), (0, 2)]
    time.sleep(0.3)
    assert len(drawn) <= 3 + 2 + 1  # read, queued, and the one waiting to be queued
    close()  # returns once the pull has stopped
    assert closed and len(drawn) < 100


def test_two_sources_are_pulled_at_once_until_both_end():
    """The tasks' blocks and the driver's own chunks come through one pull: each item tagged with
    its source, as it comes, to the end of the later source."""
    first_done = threading.Event()

    def slow():
        first_done.wait(10)  # comes after the other source's items
        yield "late"

    def quick():
        yield from ("a", "b")
        first_done.set()

    items, close = ray_merge.pulled(slow, quick)
    assert list(items) == [(1, "a"), (1, "b"), (0, "late")]
    close()


def test_an_error_of_the_pull_reaches_the_reader():
    def source():
        yield 1
        raise RuntimeError("an actor died for good")

    items, _ = ray_merge.pulled(lambda: iter([]), source)
    assert next(items) == (1, 1)
    with pytest.raises(RuntimeError, match="died for good"):
        next(items)


def chunk_result(index: int):
    from tokenmill.preprocess.engines.chunks import ChunkResult

    return ChunkResult(index, 1, 1, [("", None)], [], sizes=[5])


def test_a_block_is_handed_on_before_the_next_one_comes(ray_address):
    """Chunks reach the shard writes as soon as their block comes: none waits for later blocks
    (with a few tasks in all, every row would otherwise sit in the object store to the end)."""
    import ray

    def items():
        metas = [(row, row, chunk_result(row)) for row in (0, 1)]
        yield 0, ("block 0", ray.put(metas))
        raise AssertionError("block 1 was asked for before block 0's chunks were handed on")

    frontier = ray_head_start.Frontier(0)
    results = ray_merge.in_order(ray, items(), frontier, 4, rows_here=False)
    first, second = next(results), next(results)
    assert [first.index, second.index, frontier.index] == [0, 1, 2]
    assert first.rows[0][1] == ray_writer.RowRef("block 0", 0, 0, 5)
    with pytest.raises(AssertionError, match="block 1 was asked for"):
        next(results)


def test_the_driver_s_chunks_and_the_tasks_come_in_chunk_order(ray_address):
    """Chunks done by the driver (source 1) and by the tasks (source 0, whose blocks Ray Data may
    hand over again) in any order are handed on in chunk order, each once; a chunk from both
    sides, or one missing at the end, stops the run."""
    import ray

    def block(*indices):
        return 0, ("block", ray.put([(r, i, chunk_result(i)) for r, i in enumerate(indices)]))

    def merged(items, end=5):
        frontier = ray_head_start.Frontier(0)
        return [r.index for r in ray_merge.in_order(ray, iter(items), frontier, end, False)]

    got = merged([(1, chunk_result(2)), block(0), (1, chunk_result(3)), block(1, 4), block(4)])
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="chunk 1 twice"):
        merged([block(0, 1), (1, chunk_result(1))])
    with pytest.raises(RuntimeError, match=r"ended after chunk 2 of 0\.\.4"):
        merged([block(0, 1), (1, chunk_result(2)), (1, chunk_result(4))])
