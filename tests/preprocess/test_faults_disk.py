"""A full disk and a read-only output, on real filesystems (a small tmpfs, mounted by the test:
root only, skipped where mounting is not allowed): errors that name their cause and place."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import QWEN, ROOT

from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.runlog import OutputNotWritable

DATA = ROOT / "data"


@pytest.fixture
def tmpfs(tmp_path) -> Iterator[tuple[Path, str]]:
    """A tmpfs of 384 KiB, and the options to mount it again (remount it read-only)."""
    where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where, "size=384k"
    finally:
        subprocess.run(["umount", str(where)], check=True)


def remount(where: Path, how: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{how}", str(where)], check=True)


def test_a_full_disk_names_the_file_the_bytes_and_the_room_left(tmpfs, tmp_path):
    where, _ = tmpfs
    src = tmp_path / "c4.jsonl"
    src.write_bytes((DATA / "pretrain_c4_300.jsonl").read_bytes())  # about 1.5 MB of tokens out
    with pytest.raises(OSError) as caught:
        Pipeline(default_config("seq"), [src], where / "out", QWEN, workers=1).run()
    said = str(caught.value)
    assert str(where / "out") in said and "bytes failed" in said and "bytes free there" in said


def test_a_finished_output_on_a_read_only_disk_is_found_done_and_another_job_refused(
    tmpfs, tmp_path
):
    where, _ = tmpfs
    src = tmp_path / "c4.jsonl"
    src.write_bytes(b"".join((DATA / "pretrain_c4_300.jsonl").read_bytes().splitlines(True)[:20]))
    out = where / "out"
    first = Pipeline(default_config("seq"), [src], out, QWEN, workers=1).run()
    remount(where, "ro")
    again = Pipeline(default_config("seq"), [src], out, QWEN, workers=1).run()
    assert again.tokens == first.tokens and again.shards == first.shards
    with pytest.raises(OutputNotWritable, match=rf"{out}: cannot write there"):
        Pipeline(default_config("sft"), [src], out, QWEN, workers=1).run()
    with pytest.raises(OutputNotWritable, match=rf"{where / 'new'}: cannot write there"):
        Pipeline(default_config("seq"), [src], where / "new", QWEN, workers=1).run()
