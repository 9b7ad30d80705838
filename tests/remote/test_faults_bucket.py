"""Faults of object storage that must name their cause and place (issue 39), on moto's S3
server: a bucket that does not exist, a shard deleted from the bucket under a training job,
a lock object tokenmill did not write, and a machine's shard cache on a full disk (a small
tmpfs mounted by the test: root only, skipped where mounting is not allowed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from bucket_helpers import QWEN, small_config, source

from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.storage.bucket_lock import LOCK, BucketLock
from tokenmill.storage.remote import NoSuchBucket, ObjectMissing, Remote
from tokenmill.training.mmap_store import MmapStore

pytestmark = pytest.mark.slow  # an S3 server


def copy_to(bucket: str, local: Path, options: dict) -> str:
    """The local dataset uploaded to a bucket of this test's own (a dataset of its own to
    damage), as a plain fsspec put; its URL."""
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put(str(local) + "/", f"{bucket}/seq/", recursive=True)
    return f"s3://{bucket}/seq"


def store(url: str, cache: Path, options: dict) -> MmapStore:
    """A store of the dataset at `url`, nothing fetched ahead (a shard is fetched when read)."""
    return MmapStore(window_size=64, cache_dir=cache, storage_options=options, prefetch=0).load(url)


def last_shard(local: Path) -> str:
    return sorted(p.name for p in local.glob("shard_*"))[-1]


# --- a bucket that does not exist -------------------------------------------------------------
def test_preprocessing_to_a_bucket_that_does_not_exist_names_the_bucket(tmp_path, options):
    nope = f"nope-{uuid.uuid4().hex[:8]}"
    run = Pipeline(
        small_config("seq"),
        [source("seq", tmp_path)],
        f"s3://{nope}/out",
        QWEN,
        workers=1,
        progress=False,
        storage_options=options,
        staging_dir=tmp_path / "staging",
    )
    with pytest.raises(NoSuchBucket) as caught:
        run.run()
    assert str(caught.value) == f"s3://{nope}: no such bucket"
    with pytest.raises(NoSuchBucket, match=rf"^s3://{nope}: no such bucket$"):
        store(f"s3://{nope}/out", tmp_path / "cache", options)


# --- a shard deleted under a training job -----------------------------------------------------
@pytest.mark.parametrize("what", ["sequence.bin", "whole shard"])
def test_a_shard_deleted_from_the_bucket_while_training_is_named(
    what, datasets, options, bucket, tmp_path
):
    local, _ = datasets["seq"]
    url = copy_to(bucket, local, options)
    loaded = store(url, tmp_path / "cache", options)
    first = loaded.fetch(0, 8, "sequence")  # reading: shard 0 in the cache
    assert first.tolist() == MmapStore().load(local).fetch(0, 8, "sequence").tolist()
    gone = last_shard(local)
    remote = Remote(url, options)
    remote.remove([f"{gone}/{what}"] if what != "whole shard" else sorted(remote.listing(gone)))
    end = loaded.token_count
    with pytest.raises(ObjectMissing) as caught:
        loaded.fetch(end - 8, end, "sequence")
    said = str(caught.value)
    if what == "whole shard":  # its meta.json is read first
        assert said == f"{url}/{gone}/meta.json: no such object"
    else:
        assert said == (
            f"{url}/{gone}: shard {gone}, listed in the dataset's manifest, cannot be read "
            f"from the bucket ({url}/{gone}/sequence.bin: no such object): the dataset changed "
            f"since it was written; run `tokenmill verify {url}`"
        )
    assert "specified key does not exist" not in said
    assert loaded.fetch(0, 8, "sequence").tolist() == first.tolist()  # the rest still reads


# --- a lock tokenmill did not write -----------------------------------------------------------
@pytest.mark.parametrize("body", [b"[1, 2, 3]", b"\x00\xff\xfegarbage", b"null"])
def test_a_lock_holding_no_tokenmill_holder_is_an_unknown_run_and_named(options, bucket, body):
    url = f"s3://{bucket}/out"
    remote = Remote(url, options)
    remote.pipe(LOCK, body)
    with pytest.raises(FileExistsError) as caught:
        BucketLock(remote).acquire()
    said = str(caught.value)
    assert said.startswith(
        f"{url}: another run is writing this prefix (an unknown run: the lock holds "
        f"{len(body)} bytes that are not a tokenmill lock: "
    )
    assert said.endswith(f"; if no run writes there, remove {url}/{LOCK} yourself)")
    assert remote.cat(LOCK) == body  # left as it was
    stale = BucketLock(remote, stale_s=-1.0)  # any age is past it: a dead run's lock
    stale.acquire()
    assert stale.etag is not None and remote.cat(LOCK) != body  # taken over
    stale.release()
    assert not remote.exists(LOCK)


# --- the machine's shard cache on a full disk -------------------------------------------------
@pytest.fixture
def tmpfs(tmp_path) -> Iterator[Path]:
    """A tmpfs of 1 MiB (as tests/preprocess/test_faults_disk.py mounts one)."""
    where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)  # the cache index holds files


def test_a_full_cache_disk_names_the_cache_the_shard_the_bytes_and_the_room_left(
    tmpfs, options, bucket, tmp_path
):
    local = tmp_path / "seq"  # shards of tens of KB: more than a page or two each
    cfg = small_config("seq", shard_tokens=12_000)
    Pipeline(cfg, [source("seq", tmp_path)], local, QWEN, workers=1, progress=False).run()
    url = copy_to(bucket, local, options)
    gone = last_shard(local)
    need = sum(p.stat().st_size for p in (local / gone).iterdir() if p.name != "meta.json")
    cache = tmpfs / "cache"
    loaded = store(url, cache, options)
    loaded.fetch(0, 8, "sequence")  # the cache's folders and index made, shard 0 in it
    free = shutil.disk_usage(tmpfs).free
    room = need // 2 // 4096 * 4096  # in whole pages: less than the shard needs
    assert room >= 4096, need
    with open(tmpfs / "filler", "wb") as f:
        f.write(b"\0" * (free - room))
    left = shutil.disk_usage(tmpfs).free
    assert 0 < left < need
    end = loaded.token_count
    with pytest.raises(OSError) as caught:
        loaded.fetch(end - 8, end, "sequence")
    said = str(caught.value)
    head, free_now, tail = re.fullmatch(
        r"(.*) and ([\d,]+) (bytes are free there;.*)", said
    ).groups()
    assert head == (
        f"[Errno 28] {cache}: the shard cache's disk is full (No space left on device): "
        f"shard {gone} of {url} needs {need:,} bytes"
    )
    assert 0 < int(free_now.replace(",", "")) <= left  # less its new folder's own page
    assert tail == (
        "bytes are free there; free room on that disk, set cache_limit below the room the "
        "cache may take (now: none), or choose another cache_dir"
    )
    (tmpfs / "filler").unlink()
    assert loaded.fetch(end - 8, end, "sequence").tolist() == (
        MmapStore().load(local).fetch(end - 8, end, "sequence").tolist()
    )  # room again: the same store reads on
