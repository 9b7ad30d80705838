"""Crash consistency at every step, not at random ones: a preprocessing run is killed before
each of its writes in turn (every file written, fsync, rename into place, journal line,
task record, manifest, run-folder removal), then run again; every re-run must finish with the bytes of a
clean run and a dataset `verify` accepts, or refuse with the true reason (none is expected)."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.shards.manifest import read_manifest
from tokenmill.shards.verify import verify_dataset

pytestmark = pytest.mark.slow  # one forked run per write point
QWEN = ROOT / "data" / "tokenizers" / "qwen2.5"
WRITES = ("write_durable", "publish", "write_atomic", "fsync_dir")  # shards/files.py


class Crash:
    """Counts the run's writes; exits the process (as SIGKILL would) before write number `at`."""

    def __init__(self, at: int) -> None:
        self.at, self.count = at, 0

    def wrap(self, function):
        @functools.wraps(function)
        def counted(*args, **kwargs):
            self.count += 1
            if self.count == self.at:
                os._exit(9)
            return function(*args, **kwargs)

        return counted

    def install(self) -> None:
        """Wraps each write function wherever a tokenmill module bound it, and the writes
        that are methods: run-folder removal, a staged shard's finish."""
        from tokenmill.preprocess.run.runlog import RunFolder
        from tokenmill.shards import files
        from tokenmill.shards.writer import StagedPart, StagedShard

        originals = {getattr(files, name): name for name in WRITES}
        for module in [m for n, m in sys.modules.items() if n.startswith("tokenmill")]:
            for attr, value in list(vars(module).items()):
                if callable(value) and value in originals:
                    setattr(module, attr, self.wrap(value))
        for owner, method in (
            (RunFolder, "remove"),
            (StagedShard, "finish"),
            (StagedPart, "finish"),
        ):
            setattr(owner, method, self.wrap(getattr(owner, method)))


def run(out: Path, src: Path, config: PipelineConfig, crash_at: int | None = None) -> int:
    """The pipeline in a forked child, crashing before write `crash_at`; returns its exit
    status, or with crash_at=None the number of writes a whole run makes (its status is 0)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest machinery on the way out
        os.close(read)
        crash = Crash(crash_at or 0)
        crash.install()
        try:
            Pipeline(config, [src], out, QWEN, workers=1, on_error="skip", progress=False).run()
        except BaseException as err:  # a refusal: its text goes to the parent
            os.write(write, f"refused: {type(err).__name__}: {err}".encode())
            os._exit(3)
        os.write(write, str(crash.count).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 9), f"crash at {crash_at}: exit {code}: {said}"
    return int(said) if code == 0 and crash_at is None else code


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def manifest_of(root: Path) -> dict:
    """The manifest less what names this run: where it was written, its run id, its time."""
    manifest = read_manifest(root) or {}
    manifest.get("summary", {}).pop("seconds", None)
    return {k: v for k, v in manifest.items() if k not in ("run_id", "inputs", "tokenizer_path")}


def chat_job(
    tmp_path: Path, records: int, batch_size: int, tasks: int, shard_tokens: int, storage="bin"
) -> tuple[Path, PipelineConfig]:
    """The first `records` shipped chats, and an sft config cutting them into about `tasks`
    tasks, chunks of `batch_size` and shards of `shard_tokens` tokens."""
    lines = (ROOT / "data" / "chat_sharegpt_1000.jsonl").read_text().split("\n")
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(line + "\n" for line in lines[:records] if line))
    data = default_config("sft").model_dump(mode="json")
    data["preprocessing"].update(batch_size=batch_size, task_bytes=src.stat().st_size // tasks)
    data["output"].update(max_tokens_per_shard=shard_tokens, storage_format=storage)
    return src, PipelineConfig.from_dict(data)


@pytest.mark.parametrize("storage", ["bin", "jsonl"])
def test_a_run_killed_before_any_of_its_writes_resumes_to_the_clean_bytes(tmp_path, storage):
    src, config = chat_job(tmp_path, 24, batch_size=6, tasks=3, shard_tokens=8_000, storage=storage)
    clean = tmp_path / "clean"
    writes = run(clean, src, config)
    assert writes > 20 and verify_dataset(clean) == []
    for at in range(1, writes + 1):
        out = tmp_path / f"killed_{at}"
        assert run(out, src, config, crash_at=at) == 9
        run(out, src, config)  # finishes (exit 0) or the helper fails naming the refusal
        assert files_of(out) == files_of(clean), f"killed before write {at}"
        assert manifest_of(out) == manifest_of(clean), f"killed before write {at}"
        assert verify_dataset(out) == [], f"killed before write {at}"


@pytest.mark.parametrize("seed", [5, 6])
def test_a_run_killed_again_and_again_even_while_resuming_ends_in_the_clean_bytes(tmp_path, seed):
    """SIGKILL at random moments, several times in a row (the later kills fall in a resume),
    then a run to the end: the bytes of a clean run, and every kill left a resumable output."""
    import random
    import signal
    import subprocess
    import time

    src, config = chat_job(tmp_path, 600, batch_size=8, tasks=10, shard_tokens=20_000)
    cfg_path = tmp_path / "sft.json"
    cfg_path.write_text(config.model_dump_json())
    clean = tmp_path / "clean"
    assert run(clean, src, config) > 0
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tokenmill", "preprocess", str(src), "-o", str(out)]
    cmd += ["-c", str(cfg_path), "--tokenizer", str(QWEN), "--workers", "2"]
    cmd += ["--on-error", "skip"]
    rng = random.Random(seed)
    kills = 0
    for _ in range(6):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.5, 2.0))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert kills >= 1  # (how many land before the output is done depends on the machine's load)
    assert files_of(out) == files_of(clean) and manifest_of(out) == manifest_of(clean)
    assert verify_dataset(out) == []


def test_temp_files_a_kill_left_between_write_and_rename_are_cleared_on_resume(tmp_path):
    """SIGKILL between a temp file's write and its rename (which the write points above do
    not reach) leaves `NAME.tmp-PID` files: the resumed run clears them, ending clean."""
    src, config = chat_job(tmp_path, 24, batch_size=6, tasks=3, shard_tokens=8_000)
    clean = tmp_path / "clean"
    writes = run(clean, src, config)
    out = tmp_path / "out"
    assert run(out, src, config, crash_at=writes // 2) == 9
    for rel in (
        "shards.index",
        "manifest.json",
        "rejects.jsonl",
        ".tokenmill-run/tasks/00002.json",
    ):
        (out / f"{rel}.tmp-999999").write_bytes(b"half")
    run(out, src, config)
    assert files_of(out) == files_of(clean) and manifest_of(out) == manifest_of(clean)
    assert verify_dataset(out) == []
