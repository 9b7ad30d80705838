"""The local output lock (`.NAME.tokenmill-lock`, a file lock) holding bytes tokenmill did not
write (issue 39): a clear refusal naming the lock while a process holds it, a take-over once
none does; never a traceback from what the file holds."""

from __future__ import annotations

import pytest
from helpers import DATA, QWEN

from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.runlog import output_lock
from tokenmill.shards.files import locked

BODIES = [b"[1, 2, 3]", b"\x00\xff\xfegarbage\n", b'{"pid": "x"}', b"pid 12 on host"]


@pytest.mark.parametrize("body", BODIES)
def test_a_lock_held_with_foreign_bytes_names_an_unknown_holder_and_the_lock(tmp_path, body):
    out = tmp_path / "out"
    path = tmp_path / ".out.tokenmill-lock"
    path.write_bytes(body)
    with locked(path, wait=False):  # held by another open file: as another process holds it
        with pytest.raises(FileExistsError) as caught, output_lock(out):
            pass
    said = str(caught.value)
    assert said.startswith(
        f"{out}: another run is writing this output (an unknown process: the lock file holds "
        f"{len(body)} bytes that name no tokenmill run)"
    )
    assert f"its lock, {path}, is a file lock held by a live process: `fuser {path}` names" in said


def test_a_live_runs_own_holder_line_is_shown_as_written(tmp_path):
    out = tmp_path / "out"
    path = tmp_path / ".out.tokenmill-lock"
    path.write_bytes(b"pid 12 on host-a, started 2026-01-02T03:04:05+00:00")
    with locked(path, wait=False), pytest.raises(FileExistsError) as caught, output_lock(out):
        pass
    assert "(pid 12 on host-a, started 2026-01-02T03:04:05+00:00); wait" in str(caught.value)


@pytest.mark.parametrize("body", BODIES[:2])
def test_a_lock_nobody_holds_is_taken_over_whatever_it_holds(tmp_path, body):
    src = tmp_path / "c4.jsonl"
    src.write_bytes(b"".join((DATA / "pretrain_c4_300.jsonl").read_bytes().splitlines(True)[:5]))
    (tmp_path / ".out.tokenmill-lock").write_bytes(body)  # left by a dead process
    summary = Pipeline(default_config("seq"), [src], tmp_path / "out", QWEN, workers=1).run()
    assert summary.records_written == 5
    assert (tmp_path / ".out.tokenmill-lock").read_bytes().startswith(b"pid ")
