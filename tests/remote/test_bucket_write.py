"""Preprocessing into a bucket (moto's S3 server on loopback): the same bytes as a local run,
each shard's meta.json after its arrays, the manifest last, and a stopped run resumed from
what the bucket holds, on another machine's staging folder, byte for byte."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import fsspec
import orjson
import pytest
from bucket_helpers import QWEN, download, files_of, small_config, source

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.inputs.records import RecordError
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.task_output import read_task_records
from tokenmill.preprocess.run.upload import BucketOutput
from tokenmill.shards.verify import verify_dataset
from tokenmill.storage.remote import Remote, parse_size
from tokenmill.tools.cli import main
from tokenmill.training.dataset_factory import DatasetFactory


def local_run(tmp_path, train_type="sft"):
    src = source(train_type, tmp_path)
    cfg = small_config(train_type)
    out = tmp_path / "local"
    Pipeline(cfg, [src], out, QWEN, workers=1, on_error="skip", progress=False).run()
    return src, cfg, out


def bucket_run(cfg, src, url, options, staging, **kwargs):
    return Pipeline(
        cfg,
        [src],
        url,
        QWEN,
        workers=1,
        on_error="skip",
        progress=False,
        storage_options=options,
        staging_dir=staging,
        **kwargs,
    ).run()


@pytest.mark.slow  # an S3 server
def test_local_engine_uploads_arrays_then_meta_then_the_manifest_last(
    tmp_path, bucket, options, monkeypatch
):
    src, cfg, local = local_run(tmp_path)
    uploads: list[str] = []
    put, pipe = Remote.put, Remote.pipe

    def recording_put(self, pairs):
        uploads.extend(rel for _, rel in pairs)
        return put(self, pairs)

    def recording_pipe(self, rel, data):
        uploads.append(rel)
        return pipe(self, rel, data)

    monkeypatch.setattr(Remote, "put", recording_put)
    monkeypatch.setattr(Remote, "pipe", recording_pipe)
    url = f"s3://{bucket}/sft"
    summary = bucket_run(cfg, src, url, options, tmp_path / "staging")
    got = download(url, options, tmp_path / "got")
    assert files_of(got) == files_of(local)  # same bytes, no run folder left
    assert verify_dataset(got) == []
    assert summary.shards >= 10
    assert uploads[-1] == "manifest.json" and uploads.count("manifest.json") == 1
    metas = [i for i, rel in enumerate(uploads) if rel.endswith("/meta.json")]
    assert len(metas) == summary.shards
    for i in metas:
        shard = uploads[i].rsplit("/", 1)[0]
        files = [j for j, rel in enumerate(uploads) if rel.startswith(shard + "/")]
        assert max(files) == i, f"{shard}: a file uploaded after its meta.json"
        record = f".tokenmill-run/tasks/{shard.split('_')[1]}.json"
        assert uploads.index(record) > i, f"{shard}: its task's record came first"
    assert sum("/tasks/" in rel for rel in uploads) >= 3  # tasks, each with its record
    assert not (tmp_path / "staging").exists()  # staging removed once committed


@pytest.mark.slow  # an S3 server and several runs
def test_the_cli_writes_a_url_to_the_bucket_not_to_a_local_folder(
    tmp_path, bucket, s3_server, monkeypatch, capsys
):
    src = source("seq", tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    url = f"s3://{bucket}/seq/"
    argv = [
        "preprocess",
        str(src),
        "-o",
        url,
        "--type",
        "seq",
        "--tokenizer",
        str(QWEN),
        "--workers",
        "1",
        "--storage-option",
        f"endpoint_url={s3_server}",
    ]
    assert main(argv) == 0
    assert not (tmp_path / "s3:").exists()
    fs = fsspec.filesystem("s3", endpoint_url=s3_server, skip_instance_cache=True)
    assert fs.exists(f"{bucket}/seq/manifest.json")
    assert not fs.exists(f"{bucket}/seq/.tokenmill-run")
    capsys.readouterr()
    assert main(argv) == 0  # the same job again: already done, left as it is
    assert "records read" in capsys.readouterr().out
    assert (
        main(
            [
                "preprocess",
                str(src),
                "-o",
                url,
                "--type",
                "sft",
                "--tokenizer",
                str(QWEN),
                "--storage-option",
                f"endpoint_url={s3_server}",
            ]
        )
        == 2
    )
    assert "holds other data" in capsys.readouterr().err


@pytest.mark.slow  # an S3 server and several runs
def test_a_stopped_run_resumes_from_the_bucket_on_another_machine(
    tmp_path, bucket, options, monkeypatch
):
    """Stopped while a shard of the second task is half uploaded (its arrays there, no
    meta.json); resumed with an empty staging folder, as another machine would: the first
    task's shards are reused, not uploaded again, and the result is byte-identical to a
    clean run."""
    src, cfg, local = local_run(tmp_path)
    url = f"s3://{bucket}/sft"
    upload_shard = Remote.upload_shard

    def stop_in_the_second_task(self, path, rel):
        if rel.startswith("shard_00001_"):
            files = sorted(p for p in path.iterdir() if p.name != "meta.json")
            self.put([(files[0], f"{rel}/{files[0].name}")])  # half a shard, then the stop
            raise KeyboardInterrupt
        return upload_shard(self, path, rel)

    monkeypatch.setattr(Remote, "upload_shard", stop_in_the_second_task)
    with pytest.raises(KeyboardInterrupt):
        bucket_run(cfg, src, url, options, tmp_path / "staging-a")
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    keys = fs.find(f"{bucket}/sft")
    assert f"{bucket}/sft/manifest.json" not in keys
    assert f"{bucket}/sft/.tokenmill-run/tasks/00000.json" in keys
    assert f"{bucket}/sft/.tokenmill-run/tasks/00001.json" not in keys
    assert any(k.startswith(f"{bucket}/sft/shard_00001_000/") for k in keys)  # the orphan
    before = {k: fs.info(k)["LastModified"] for k in keys if "/shard_00000_" in k}
    assert before
    time.sleep(1.1)  # LastModified counts seconds
    monkeypatch.setattr(Remote, "upload_shard", upload_shard)
    bucket_run(cfg, src, url, options, tmp_path / "staging-b")
    got = download(url, options, tmp_path / "got")
    assert files_of(got) == files_of(local)
    for k, stamp in before.items():
        assert fs.info(k)["LastModified"] == stamp, f"{k} uploaded again"


@pytest.mark.slow  # an S3 server and several runs
def test_another_jobs_data_is_refused_and_overwrite_replaces_it(tmp_path, bucket, options):
    src, cfg, local = local_run(tmp_path, "seq")
    url = f"s3://{bucket}/data"
    Remote(url, options).pipe("notes.txt", b"mine")
    with pytest.raises(FileExistsError, match="not a tokenmill output"):
        bucket_run(cfg, src, url, options, tmp_path / "s", overwrite=True)
    Remote(url, options).remove(["notes.txt"])
    bucket_run(cfg, src, url, options, tmp_path / "s")
    other = small_config("seq", shard_tokens=7_000)
    with pytest.raises(FileExistsError, match="holds other data"):
        bucket_run(other, src, url, options, tmp_path / "s")
    bucket_run(other, src, url, options, tmp_path / "s", overwrite=True)
    got = download(url, options, tmp_path / "got")
    assert verify_dataset(got) == []
    assert files_of(got) != files_of(local)


@pytest.mark.slow  # an S3 server and several runs
def test_a_bad_record_leaves_nothing_in_the_bucket(tmp_path, bucket, options):
    src = source("sft", tmp_path)
    src.write_text(src.read_text() + '{"conversations": 7}\n')
    url = f"s3://{bucket}/bad"
    with pytest.raises(RecordError):
        Pipeline(
            small_config("sft"),
            [src],
            url,
            QWEN,
            workers=1,
            progress=False,
            storage_options=options,
            staging_dir=tmp_path / "s",
        ).run()
    assert Remote(url, options).listing() == {}


def test_only_whole_records_of_this_run_s_tasks_count_as_done(tmp_path):
    tasks = tmp_path / ".tokenmill-run" / "tasks"
    tasks.mkdir(parents=True)
    (tasks / "00000.json").write_bytes(orjson.dumps({"task": 0, "counts": {}}))
    (tasks / "00001.json").write_bytes(b'{"task": 1, "cou')  # torn: done again
    (tasks / "00002.json").write_bytes(orjson.dumps({"task": 7}))  # not its own: done again
    (tasks / "00003.json.tmp-12").write_bytes(b"{}")
    assert list(read_task_records(tmp_path, None)) == [0]


def test_a_url_that_lost_a_slash_is_refused(tmp_path):
    from pathlib import Path

    with pytest.raises(ValueError, match="lost a slash"):
        Pipeline(small_config("seq"), [source("seq", tmp_path)], Path("s3://bucket/x"), QWEN)
    assert BucketOutput("s3://b/x/", {"endpoint_url": "http://127.0.0.1:1"}).url == "s3://b/x"


@pytest.mark.slow  # kills a process
def test_a_killed_cli_run_resumes_from_the_bucket(tmp_path, bucket, s3_server):
    src, cfg, local = local_run(tmp_path)
    cfg_path = tmp_path / "sft.json"
    cfg_path.write_text(cfg.model_dump_json())
    url = f"s3://{bucket}/sft"
    env = {**os.environ, "AWS_ENDPOINT_URL": s3_server, "TMPDIR": str(tmp_path)}
    cmd = [
        sys.executable,
        "-m",
        "tokenmill",
        "preprocess",
        str(src),
        "-o",
        url,
        "-c",
        str(cfg_path),
        "--tokenizer",
        str(QWEN),
        "--workers",
        "1",
        "--on-error",
        "skip",
    ]
    fs = fsspec.filesystem("s3", endpoint_url=s3_server, skip_instance_cache=True)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        fs.invalidate_cache()
        if fs.exists(f"{bucket}/sft/.tokenmill-run/tasks/00001.json"):
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    fs.invalidate_cache()
    assert not fs.exists(f"{bucket}/sft/manifest.json")
    env["TMPDIR"] = str(tmp_path / "elsewhere")  # another machine: an empty staging folder
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert files_of(download(url, {"endpoint_url": s3_server}, tmp_path / "got")) == files_of(local)


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # Ray
def test_the_ray_engine_writes_the_same_bytes_to_the_bucket(tmp_path, bucket, options, ray_session):
    """Each Ray task stages its shards on its node and uploads them, then its record."""
    src, cfg, local = local_run(tmp_path)
    url = f"s3://{bucket}/ray"
    Pipeline(
        cfg,
        [src],
        url,
        QWEN,
        workers=2,
        on_error="skip",
        engine="ray",
        progress=False,
        storage_options=options,
        staging_dir=tmp_path / "staging",
    ).run()
    got = download(url, options, tmp_path / "got")
    assert files_of(got) == files_of(local)
    assert verify_dataset(got) == []


@pytest.mark.slow  # an S3 server and several runs
def test_uploads_through_a_server_that_drops_connections(tmp_path, bucket, proxy, options):
    from tokenmill.storage import remote as remote_module

    src, cfg, local = local_run(tmp_path, "seq")
    proxy.dropping.set()
    retries = remote_module.STATS.retries
    url = f"s3://{bucket}/seq"
    bucket_run(cfg, src, url, {"endpoint_url": proxy.url}, tmp_path / "staging")
    assert proxy.dropped > 0 and remote_module.STATS.retries > retries
    assert files_of(download(url, options, tmp_path / "got")) == files_of(local)


def test_sizes_read_as_people_write_them():
    assert parse_size("20GB") == 20 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size(1234) == 1234 and parse_size(None) is None
    with pytest.raises(ValueError, match="cannot read the size"):
        parse_size("lots")


@pytest.mark.slow  # an S3 server (and Ray)
@pytest.mark.parametrize("engine", ["local", "ray"])
def test_a_split_run_in_a_bucket_is_the_local_bytes_and_its_root_is_refused(
    tmp_path, bucket, options, engine, request
):
    """train/ and validation/ are datasets of their own in the bucket as on disk (their
    manifests uploaded before the root's; Ray tasks stage their shards on their own, so the
    driver makes the split folders it writes them in); loading the root is refused."""
    if engine == "ray":
        request.getfixturevalue("ray_session")
    data = small_config("seq").model_dump(mode="json")
    data["preprocessing"]["validation"] = {"fraction": 0.2, "by": "document", "seed": 1}
    cfg = PipelineConfig.from_dict(data)
    src = source("seq", tmp_path)
    local = tmp_path / "local"
    Pipeline(cfg, [src], local, QWEN, workers=1, on_error="skip", progress=False).run()
    url = f"s3://{bucket}/split-{engine}"
    bucket_run(cfg, src, url, options, tmp_path / "s", engine=engine)
    got = download(url, options, tmp_path / "got")
    assert files_of(got) == files_of(local)
    assert (got / "train" / "manifest.json").is_file()
    with pytest.raises(ValueError, match=f"{url} holds the splits train and validation"):
        DatasetFactory.load("seq", url, window_size=64, storage_options=options)
    for split in ("train", "validation"):
        loaded = DatasetFactory.load(
            "seq", f"{url}/{split}", window_size=64, storage_options=options,
            cache_dir=tmp_path / f"cache-{split}",
        )  # fmt: skip
        assert len(loaded) == len(DatasetFactory.load("seq", local / split, window_size=64))
