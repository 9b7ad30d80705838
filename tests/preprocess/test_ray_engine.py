"""Ray engine, on a cluster of several raylets on this machine: byte-identical output to the
local engine for any worker count, tasks and drivers killed at random points and resumed on a
cluster of another size, the driver's memory flat in the number of records, no Ray."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from helpers import ROOT
from test_tasks import lines_of, mixed_inputs

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.ray import engine as ray_engine
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest
from tokenmill.shards.reader import find_shards

pytestmark = pytest.mark.slow  # Ray

DATA = ROOT / "data"
QWEN = DATA / "tokenizers" / "qwen2.5"
TYPES = {
    "seq": "pretrain_c4_300.jsonl",
    "instruction": "instruction_humaneval.jsonl",
    "sft": "chat_sharegpt_1000.jsonl",
    "dpo": "dpo_en_300.jsonl",
    "grpo": "grpo_from_dpo_300.jsonl",
}
RAYLETS = 3  # the head and two more, one CPU each: tasks land on every one of them


def config(
    train_type: str, batch_size: int = 6, shard_tokens: int = 4_000, task_bytes: int = 20_000
) -> PipelineConfig:
    data = default_config(train_type).model_dump(mode="json")
    data["preprocessing"].update(batch_size=batch_size, task_bytes=task_bytes)
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
    assert sum(name.endswith(("meta.json", ".jsonl")) for name in files) >= 2
    manifest, expected = read_manifest(out), read_manifest(reference)
    assert manifest["fingerprint"] == expected["fingerprint"]
    assert manifest["domains"] == expected["domains"]
    for key in ("records_read", "records_written", "skipped", "rows", "tokens", "trained_tokens"):
        assert manifest["summary"][key] == expected["summary"][key], key


@pytest.mark.parametrize(
    ("cpus", "workers", "expected"),
    [
        (2, None, (1, 2.0)),
        (2, 1, (1, 2.0)),
        (2, 8, (4, 0.5)),
        (16, 64, (32, 0.5)),
        (16, None, (8, 2.0)),
        (1, None, (1, 1.0)),
        (3, 3, (2, 1.5)),
    ],
)
def test_the_tasks_share_the_cluster_s_cpus_two_threads_each(cpus, workers, expected):
    size, share = ray_engine.pool_size(cpus, workers)
    assert (size, share) == expected and size * share <= cpus
    assert ray_engine.pool_size(cpus, workers, node=1.0) == (size, min(share, 1.0))  # fits a node
    with pytest.raises(ValueError, match="workers=500 is more than a Ray cluster of 2 CPUs"):
        ray_engine.pool_size(2, 500)


def test_without_ray_the_message_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 5)
    with pytest.raises(ImportError, match=r"pip install 'tokenmill\[ray\]'"):
        Pipeline(config("seq"), [src], tmp_path / "out", QWEN, engine="ray").run()


def test_max_items_is_refused_before_any_output(tmp_path):
    src = head(DATA / "pretrain_c4_300.jsonl", tmp_path / "c4.jsonl", 5)
    data = config("seq").model_dump(mode="json")
    data["preprocessing"]["max_items"] = 3
    with pytest.raises(ValueError, match="max_items .* use the local engine"):
        Pipeline(PipelineConfig.from_dict(data), [src], tmp_path / "o", QWEN, engine="ray").run()
    assert not (tmp_path / "o").exists()


# ---- on a Ray cluster of several raylets ---------------------------------------------------


@pytest.fixture(scope="module")
def ray_address():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(RAYLETS - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


def nodes_of(folder: Path) -> set[str]:
    return {p.read_text() for p in folder.iterdir()}


def noting_nodes(folder: Path):
    """`run_task`, noting the node each task ran on (defined here: Ray ships it by value)."""
    real = ray_engine.run_task
    folder.mkdir()

    def run(plan, *args):
        import ray

        (folder / str(plan.index)).write_text(ray.get_runtime_context().get_node_id())
        return real(plan, *args)

    return run


@pytest.mark.parametrize(
    ("train_type", "workers"),
    [("seq", 3), ("instruction", 1), ("sft", 2), ("dpo", 3), ("grpo", 1), ("grpo", 3)],
)
def test_every_training_type_matches_the_local_engine(
    tmp_path, ray_address, monkeypatch, train_type, workers
):
    src = head(DATA / TYPES[train_type], tmp_path / TYPES[train_type], 60)
    cfg = config(train_type, task_bytes=src.stat().st_size // 5)
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    monkeypatch.setattr(ray_engine, "run_task", noting_nodes(tmp_path / "nodes"))
    Pipeline(
        cfg, [src], tmp_path / "ray", QWEN, workers=workers, on_error="skip", engine="ray"
    ).run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    assert len(list((tmp_path / "nodes").iterdir())) >= 5  # tasks, each its own shards
    if workers == 3:
        assert len(nodes_of(tmp_path / "nodes")) >= 2


def test_domains_jsonl_and_rejects_match_the_local_engine(tmp_path, ray_address):
    lines = [
        json.dumps({**json.loads(line), "lang": "ab"[i % 3 == 0]}) + "\n"
        for i, line in enumerate(lines_of(DATA / "chat_sharegpt_1000.jsonl")[:50])
    ]
    lines[7] = "{not json\n"
    lines[30] = '{"messages": "hello", "lang": "b"}\n'
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(lines))
    for storage in ("bin", "jsonl"):
        data = config("sft", task_bytes=src.stat().st_size // 4).model_dump(mode="json")
        data["output"].update(domain_key="lang", storage_format=storage)
        cfg = PipelineConfig.from_dict(data)
        local = tmp_path / f"local_{storage}"
        ray = tmp_path / f"ray_{storage}"
        Pipeline(cfg, [src], local, QWEN, workers=1, on_error="skip").run()
        Pipeline(cfg, [src], ray, QWEN, workers=3, on_error="skip", engine="ray").run()
        assert_same_dataset(ray, local)
        assert sorted(read_manifest(ray)["domains"]) == ["a", "b"]
        rejects = [json.loads(r) for r in (ray / "rejects.jsonl").read_text().splitlines()]
        assert [(r["line"], r["reason"]) for r in rejects] == [(8, "bad_json"), (31, "wrong_type")]


def test_every_input_format_and_bad_records_match_the_local_engine(tmp_path, ray_address):
    files = mixed_inputs(tmp_path / "mixed")
    cfg = config("sft", batch_size=4, shard_tokens=3_000, task_bytes=2_000)
    local = Pipeline(cfg, files, tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    Pipeline(cfg, files, tmp_path / "ray", QWEN, workers=3, on_error="skip", engine="ray").run()
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
        Pipeline(cfg, files, tmp_path / "raise", QWEN, workers=3, engine="ray").run()
    assert find_shards(tmp_path / "raise") == [] and read_manifest(tmp_path / "raise") is None
    assert [p.name for p in (tmp_path / "raise").iterdir()] == []


def test_text_files_read_per_line_match_the_local_engine(tmp_path, ray_address):
    folder = tmp_path / "texts"
    folder.mkdir()
    plays = [json.loads(line)["text"] for line in lines_of(DATA / "pretrain_shakespeare.jsonl")]
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
    cfg = config("sft", batch_size=4, shard_tokens=3_000, task_bytes=2_000)
    Pipeline(cfg, files, tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    urls = [f.as_uri() for f in files]  # read through fsspec, as s3:// or gs:// would be
    Pipeline(cfg, urls, tmp_path / "ray", QWEN, workers=2, on_error="skip", engine="ray").run()
    rejects = (tmp_path / "ray" / "rejects.jsonl").read_text()
    for f, url in zip(files, urls, strict=True):
        rejects = rejects.replace(url, str(f))
    assert rejects == (tmp_path / "local" / "rejects.jsonl").read_text()
    (tmp_path / "ray" / "rejects.jsonl").write_text(rejects)
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")
    assert read_manifest(tmp_path / "ray")["inputs"] == urls


def dying_once(folder: Path, seed: int):
    """`run_task`, whose process dies once per task at a random one of its writes (a file, a
    fsync, a rename, its record), or not at all (defined here: Ray ships it by value)."""
    real = ray_engine.run_task
    folder.mkdir()

    def run(plan, *args):
        marker = folder / str(plan.index)
        if not marker.exists():
            marker.touch()
            at = random.Random(seed * 1_000 + plan.index).randint(1, 40)
            from tokenmill.preprocess.run import task_output
            from tokenmill.shards import writer

            count = [0]

            def dying(function):
                def counted(*a, **k):
                    count[0] += 1
                    if count[0] == at:
                        os._exit(1)
                    return function(*a, **k)

                return counted

            for module in (writer, task_output):
                for name in ("write_durable", "publish", "write_atomic", "fsync_dir"):
                    if hasattr(module, name):
                        setattr(module, name, dying(getattr(module, name)))
        return real(plan, *args)

    return run


@pytest.mark.parametrize("seed", [1, 2])
def test_tasks_killed_at_random_writes_are_redone_and_nothing_is_lost_or_doubled(
    tmp_path, ray_address, monkeypatch, seed
):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 80)
    cfg = config("sft", shard_tokens=3_000, task_bytes=src.stat().st_size // 6)
    monkeypatch.setattr(ray_engine, "run_task", dying_once(tmp_path / "died", seed))
    Pipeline(cfg, [src], tmp_path / "ray", QWEN, workers=3, on_error="skip", engine="ray").run()
    Pipeline(cfg, [src], tmp_path / "local", QWEN, workers=1, on_error="skip").run()
    assert_same_dataset(tmp_path / "ray", tmp_path / "local")  # also: no temp file left over
    assert len(list((tmp_path / "died").iterdir())) >= 6


def cli(src: Path, out: Path, cfg_path: Path, workers: int, address: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "tokenmill", "preprocess", str(src), "-o", str(out)]
    cmd += ["-c", str(cfg_path), "--tokenizer", str(QWEN), "--workers", str(workers)]
    cmd += ["--on-error", "skip", "--engine", "ray"]
    return cmd + (["--ray-address", address] if address else [])


@pytest.mark.parametrize("seed", [3, 4])
def test_a_driver_killed_at_a_random_point_resumes_on_a_cluster_of_another_size(
    tmp_path, ray_address, seed
):
    src = head(DATA / "chat_sharegpt_1000.jsonl", tmp_path / "chat.jsonl", 300)
    cfg = config("sft", batch_size=8, shard_tokens=10_000, task_bytes=src.stat().st_size // 8)
    cfg_path = tmp_path / "sft.json"
    cfg_path.write_text(cfg.model_dump_json())
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen(
        cli(src, out, cfg_path, 3, ray_address),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    tasks = out / ".tokenmill-run" / "tasks"
    deadline = time.time() + 180
    while not (tasks.is_dir() and any(tasks.iterdir())) and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(random.Random(seed).uniform(0, 1.0))
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert read_manifest(out) is None
    done_before = {p.name: p.stat().st_mtime_ns for p in tasks.iterdir()}
    # the same command on a cluster of one node and two CPUs that the CLI starts for itself
    done = subprocess.run(
        cli(src, out, cfg_path, 1, "local"), cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    Pipeline(cfg, [src], tmp_path / "clean", QWEN, workers=1, on_error="skip").run()
    assert_same_dataset(out, tmp_path / "clean")
    assert done_before and not (out / ".tokenmill-run").exists()


def test_the_driver_s_memory_does_not_grow_with_the_records(tmp_path, ray_address):
    """Driver-side Python allocations at their peak, for 2,000 and 20,000 records: the driver
    holds tasks' records (a few hundred bytes each), never a record or a row."""
    peaks = []
    for records in (2_000, 20_000):
        src = tmp_path / f"{records}.jsonl"
        src.write_text("".join(json.dumps({"text": f"w{i} " * 3}) + "\n" for i in range(records)))
        data = config("seq", batch_size=256).model_dump(mode="json")
        data["preprocessing"].update(min_chars=1, task_bytes=src.stat().st_size // 4 + 1)
        cfg = PipelineConfig.from_dict(data)
        tracemalloc.start()
        Pipeline(cfg, [src], tmp_path / f"out_{records}", QWEN, workers=3, engine="ray").run()
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] < peaks[0] + (1 << 20), peaks  # 10x the records: under 1 MiB more
