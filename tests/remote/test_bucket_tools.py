"""Object storage, continued: shards fetched ahead of a shuffled sample order (same batches
as a local copy, with a cache smaller than the dataset; nothing asked again once the cache
holds every shard); `tokenmill verify|inspect|show` on a URL; and the lock in the bucket
that keeps two runs on different machines from writing the same prefix."""

from __future__ import annotations

import json
import threading
import time

import fsspec
import pytest
import torch
from bucket_helpers import QWEN, small_config, source
from test_bucket_read import batches, dataset_bytes, largest_shard, load, loader, same
from torch.utils.data import DataLoader

from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.preprocess.run.upload import BucketOutput
from tokenmill.shards.manifest import read_manifest
from tokenmill.storage import bucket_lock
from tokenmill.storage.bucket_lock import LOCK, BucketLock
from tokenmill.storage.remote import Remote
from tokenmill.tools.cli import main
from tokenmill.training import order_prefetch
from tokenmill.training.sampler import RDSampler

pytestmark = pytest.mark.slow  # an S3 server


# --- ahead of the sample order ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["seq", "sft"])
def test_a_shuffled_epoch_through_a_small_cache_is_fetched_ahead_and_reads_the_local_batches(
    kind, datasets, options, tmp_path
):
    local, url = datasets[kind]
    limit = max(dataset_bytes(local) // 3, 3 * largest_shard(local))
    expected = batches(loader(load(kind, local), workers=0, seed=5))
    dataset = load(kind, url, cache_dir=tmp_path / "c", cache_limit=limit, storage_options=options)
    dataset.store.max_open_shards = 1  # every shard read from the cache, not kept mapped
    assert same(batches(loader(dataset, workers=0, seed=5)), expected)
    stats = dataset.store.cache_stats()
    assert stats["ahead"] > 0 and stats["evictions"] > 0


def test_once_every_shard_is_cached_the_order_asks_nothing(datasets, options, tmp_path):
    local, url = datasets["sft"]
    dataset = load("sft", url, cache_dir=tmp_path / "c", storage_options=options)
    dataset.store.max_open_shards = 1
    expected = batches(loader(load("sft", local), workers=0))
    assert same(batches(loader(dataset, workers=0)), expected)
    ahead = dataset.store.cache_stats()["ahead"]
    prefetch_items, calls = dataset.store.prefetch_items, []
    dataset.store.prefetch_items = lambda *args: calls.append(args) or prefetch_items(*args)
    assert same(batches(loader(dataset, workers=0)), expected)
    assert dataset.store.cache_stats()["ahead"] == ahead
    assert calls == []  # every shard known cached and none evicted: the order stops looking


def test_rdsampler_in_a_plain_dataloader_fetches_ahead_and_reads_the_local_batches(
    datasets, options, tmp_path
):
    """RDSampler's order is fetched ahead in the training process, into the machine's cache
    that the DataLoader's workers read."""
    local, url = datasets["seq"]
    limit = max(dataset_bytes(local) // 3, 3 * largest_shard(local))

    def epoch(dataset):
        sampler = RDSampler(dataset, seed=5, rank=0, world_size=1)
        return list(DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2))

    expected = epoch(load("seq", local))
    dataset = load("seq", url, cache_dir=tmp_path / "c", cache_limit=limit, storage_options=options)
    got = epoch(dataset)
    assert len(got) == len(expected)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(got, expected, strict=True) for k in a)
    assert dataset.store.cache_stats()["ahead"] > 0  # this process's look-ahead downloads


def test_no_read_ahead_for_data_on_disk(datasets):
    local, _ = datasets["seq"]
    assert order_prefetch.order_prefetch(load("seq", local), 0, True) is None


# --- the tools on a URL --------------------------------------------------------------------
def test_verify_inspect_and_show_take_a_url(datasets, options, bucket, tmp_path, capsys):
    local, url = datasets["sft"]
    opt = ["--storage-option", f"endpoint_url={options['endpoint_url']}"]
    assert main(["verify", url, "--json", *opt]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert main(["inspect", str(local), "--json"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert main(["inspect", url, "--json", *opt]) == 0
    there = json.loads(capsys.readouterr().out)
    assert there["path"] == url and there["domains"] == here["domains"]
    assert main(["show", str(local), "--index", "3", "--color", "never"]) == 0
    shown = capsys.readouterr().out
    assert main(["show", url, "--index", "3", "--color", "never", *opt]) == 0
    assert capsys.readouterr().out == shown
    # a corrupted object (same size) and a missing one: named, with the URL's shard
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put(str(local) + "/", f"{bucket}/sft/", recursive=True)
    first, second = [info["name"] for info in read_manifest(local)["domains"][""][1:3]]
    data = bytearray((local / first / "sequence.bin").read_bytes())
    data[4] ^= 0xFF
    fs.pipe(f"{bucket}/sft/{first}/sequence.bin", bytes(data))
    fs.rm(f"{bucket}/sft/{second}/loss_mask.bin")
    assert main(["verify", f"s3://{bucket}/sft", "--json", *opt]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert any(first in p and "sequence" in p for p in problems), problems
    assert any(second in p and "loss_mask" in p for p in problems), problems
    assert not any(str(tmp_path) in p or "tokenmill-copy" in p for p in problems)


# --- the lock in the bucket ----------------------------------------------------------------
def run_to(url, options, staging, tmp_path):
    src = source("seq", tmp_path)
    return Pipeline(
        small_config("seq"),
        [src],
        url,
        QWEN,
        workers=1,
        on_error="skip",
        progress=False,
        storage_options=options,
        staging_dir=staging,
    )


def test_moto_honours_conditional_puts(options, bucket):
    lock = BucketLock(Remote(f"s3://{bucket}/x", options))
    assert lock._put(IfNoneMatch="*") is not None
    assert lock._put(IfNoneMatch="*") is None  # exists: refused
    assert lock._put(IfMatch='"0123"') is None  # not that version: refused


def test_a_second_writer_of_the_prefix_is_refused_naming_the_holder(options, bucket, tmp_path):
    url = f"s3://{bucket}/seq"
    other = BucketLock(Remote(url, options))  # a run on another machine, alive
    other.holder.update(host="elsewhere", pid=4242)
    other.acquire()
    try:
        with pytest.raises(FileExistsError, match=r"another run is writing.*pid 4242 on elsewhere"):
            run_to(url, options, tmp_path / "staging", tmp_path).run()
        assert Remote(url, options).listing() == {LOCK: Remote(url, options).listing()[LOCK]}
    finally:
        other.release()
    summary = run_to(url, options, tmp_path / "staging", tmp_path).run()  # released: proceeds
    assert summary.records_written > 0
    assert LOCK not in Remote(url, options).listing()  # removed at the end


def test_a_stale_lock_is_taken_over_and_its_run_stops_before_commit(
    options, bucket, tmp_path, monkeypatch
):
    url = f"s3://{bucket}/seq"
    dead = BucketLock(Remote(url, options), heartbeat_s=3600)
    dead.holder.update(host="gone", pid=1)
    dead.acquire()
    monkeypatch.setattr(bucket_lock, "STALE_S", 1.0)
    time.sleep(2.5)  # LastModified has a 1 s resolution
    summary = run_to(url, options, tmp_path / "staging", tmp_path).run()
    assert summary.records_written > 0 and LOCK not in Remote(url, options).listing()
    dead.refresh()  # the dead run wakes up: its lock is gone to another run
    assert dead.lost
    with pytest.raises(RuntimeError, match="no longer holds the prefix's lock"):
        dead.check()
    dead.release()


def test_late_heartbeats_do_not_lose_a_lock_nobody_took(options, bucket):
    """On a loaded machine the heartbeat can be late past the stale time: the commit's check
    reads the lock back and goes on while it is still this run's write."""
    lock = BucketLock(Remote(f"s3://{bucket}/late", options), stale_s=0.0, heartbeat_s=3600)
    lock.acquire()
    lock.refreshed -= 10.0  # ten stale times without a heartbeat
    before = lock.etag
    lock.check(server=True)
    assert not lock.lost and lock.etag != before  # rewritten: fresh while the commit runs
    thief = BucketLock(Remote(f"s3://{bucket}/late", options), stale_s=0.0, heartbeat_s=3600)
    thief.holder.update(host="elsewhere", pid=4242)
    time.sleep(1.5)  # LastModified has a 1 s resolution
    thief.acquire()  # past its (zero) stale time: taken over
    with pytest.raises(RuntimeError, match="no longer holds the prefix's lock"):
        lock.check(server=True)
    thief.release()
    lock.release()  # lost: another run's lock is not removed
    assert not Remote(f"s3://{bucket}/late", options).exists(LOCK)


def test_refreshes_racing_each_other_never_lose_the_lock(options, bucket):
    """The run's own write and its heartbeat's at once: one If-Match fails on the other's new
    ETag, and the lock, still naming this run, stays held."""
    lock = BucketLock(Remote(f"s3://{bucket}/race", options), heartbeat_s=3600)
    lock.acquire()
    lock.run_id = "r1"
    threads = [threading.Thread(target=lambda: [lock.refresh() for _ in range(8)]) for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not lock.lost
    lock.check(server=True)
    lock.release()


def test_a_run_whose_lock_was_taken_over_writes_and_deletes_nothing(options, bucket, tmp_path):
    url = f"s3://{bucket}/taken"
    Remote(url, options).pipe("shard_00000/meta.json", b"{}")  # what the new holder wrote
    output = BucketOutput(url, options, tmp_path / "staging")
    with output.held():
        thief = BucketLock(Remote(url, options), stale_s=0.0, heartbeat_s=3600)
        thief.holder.update(host="elsewhere", pid=4242)
        time.sleep(1.5)  # LastModified has a 1 s resolution
        thief.acquire()  # past its (zero) stale time: taken over
        with pytest.raises(RuntimeError, match="no longer holds the prefix's lock"):
            output.lock.check(server=True)
        output.abort(remove=True)  # bad input would delete the run's objects: not another's
        assert "shard_00000/meta.json" in Remote(url, options).listing()
    thief.release()
    assert not Remote(url, options).exists(LOCK)
