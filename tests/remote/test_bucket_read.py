"""Training from a bucket (moto's S3 server on loopback) through the local shard cache: the
same batches as from a local copy, with 2 DataLoader workers and a cache smaller than the
dataset; one download per shard per machine; resume; corrupted objects, dropped
connections, and a cache changed or removed under a running job."""

from __future__ import annotations

import json
import os
import shutil
import threading

import fsspec
import numpy as np
import pytest
import torch
from bucket_helpers import files_of

from tokenmill import DataflowLoader, DatasetFactory, MapDistributor
from tokenmill.dataflow import SFTPaddingCollator, SimpleBatcher
from tokenmill.storage import remote as remote_module
from tokenmill.storage.remote import Remote
from tokenmill.training.mmap_store import MmapStore

pytestmark = pytest.mark.slow  # an S3 server, DataLoader workers

KINDS = {  # windows, read a group at once; whole rows, one by one
    "seq": {"window_size": 256},
    "sft": {"window_size": 2048, "sample": "row"},
}


def load(kind, path, **kwargs):
    return DatasetFactory.load(kind, str(path), **KINDS[kind], **kwargs)


def loader(dataset, workers=2, seed=3):
    roles = (
        {"batch_size": 4}
        if dataset.train_type == "seq"
        else {"batcher": SimpleBatcher(4), "collator": SFTPaddingCollator()}
    )
    return DataflowLoader(
        MapDistributor(dataset, seed=seed, num_epochs=1), num_workers=workers, **roles
    )


def batches(loader_, stop=None):
    out = []
    for batch in loader_:
        out.append({k: v.clone() for k, v in batch.items()})
        if stop is not None and len(out) == stop:
            break
    return out


def same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def dataset_bytes(local):
    return sum(len(v) for k, v in files_of(local).items() if "/" in k)


def largest_shard(local):
    sizes: dict[str, int] = {}
    for rel, data in files_of(local).items():
        if "/" in rel:
            sizes[rel.split("/")[0]] = sizes.get(rel.split("/")[0], 0) + len(data)
    return max(sizes.values())


@pytest.mark.parametrize("kind", list(KINDS))
def test_two_workers_and_a_small_cache_give_the_local_batches_and_resume(
    kind, datasets, options, tmp_path
):
    local, url = datasets[kind]
    limit = max(dataset_bytes(local) // 3, 3 * largest_shard(local))
    assert limit < dataset_bytes(local)
    remote = dict(cache_dir=tmp_path / "cache", cache_limit=limit, storage_options=options)
    expected = batches(loader(load(kind, local)))
    dataset = load(kind, url, **remote)
    assert dataset.fingerprint == load(kind, local).fingerprint  # resume states carry over
    got = batches(loader(dataset))
    assert same(got, expected)
    stats = dataset.store.cache_stats()
    assert stats["evictions"] > 0 and stats["downloads"] > 0
    # stop after 5 batches, resume in a new loader from its state: the rest, exactly
    first = loader(load(kind, url, **remote))
    head = batches(first, stop=5)
    state = json.loads(json.dumps(first.state_dict()))
    again = loader(load(kind, url, **remote))
    again.load_state_dict(state)
    assert same(head + batches(again), expected)


def test_one_download_per_shard_per_machine(datasets, options, tmp_path):
    local, url = datasets["seq"]
    dataset = load("seq", url, cache_dir=tmp_path / "cache", storage_options=options)
    assert same(batches(loader(dataset)), batches(loader(load("seq", local))))
    shards = len(json.loads((local / "manifest.json").read_text())["domains"][""])
    assert dataset.store.cache_stats()["downloads"] == shards  # 2 workers, the fill, one each
    again = load("seq", url, cache_dir=tmp_path / "cache", storage_options=options)
    assert same(batches(loader(again, workers=0)), batches(loader(load("seq", local))))
    assert again.store.cache_stats()["downloads"] == shards  # warm: nothing fetched again


def test_the_first_item_does_not_wait_for_the_whole_dataset(datasets, options, tmp_path):
    local, url = datasets["seq"]
    limit = dataset_bytes(local) // 2  # the dataset does not fit: no background fill
    store = MmapStore(
        window_size=256, cache_dir=tmp_path / "c", cache_limit=limit, storage_options=options
    )
    store.load(url)
    assert store.cache_stats().get("downloads", 0) == 0  # load reads metadata only
    reference = MmapStore(window_size=256).load(local)
    window = store.window_at(0)
    assert torch.equal(store.fetch(*window, "sequence"), reference.fetch(*window, "sequence"))
    assert store.cache_stats()["downloads"] == 1


def test_a_corrupted_object_is_fetched_again_then_refused_naming_the_shard(
    datasets, options, bucket, tmp_path
):
    local, _ = datasets["seq"]
    url = f"s3://{bucket}/seq"
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put(str(local) + "/", f"{bucket}/seq/", recursive=True)
    data = bytearray((local / "shard_00000_002" / "sequence.bin").read_bytes())
    data[10] ^= 0xFF  # same size, another byte
    fs.pipe(f"{bucket}/seq/shard_00000_002/sequence.bin", bytes(data))
    store = MmapStore(
        window_size=256, cache_dir=tmp_path / "c", storage_options=options, prefetch=0
    )
    store.load(url)
    before = remote_module.STATS.refetches
    with pytest.raises(ValueError, match=r"shard_00000_002: sequence\.bin: size or xxh64 differs"):
        store.fetch(store._starts["sequence"][2], store._starts["sequence"][2] + 5, "sequence")
    assert remote_module.STATS.refetches == before + 1
    assert store.fetch(0, 5, "sequence").shape == (5,)  # the other shards read as ever
    assert not (store.source.cache.dir / "shards" / "shard_00000_002" / "sequence.bin").exists()


def test_a_download_corrupted_on_the_way_is_fetched_again(datasets, options, tmp_path, monkeypatch):
    local, url = datasets["seq"]
    get, spoiled, lock = Remote.get, [], threading.Lock()

    def spoil_the_first(self, pairs, sizes=None):
        get(self, pairs, sizes)
        with lock:  # the fill thread and a read may download at once: spoil one of them only
            if spoiled or str(tmp_path) not in str(pairs[0][1]):
                return
            spoiled.append(pairs[0][0])
        path = pairs[0][1]
        data = bytearray(path.read_bytes())
        data[0] ^= 0xFF
        path.write_bytes(bytes(data))

    monkeypatch.setattr(Remote, "get", spoil_the_first)
    dataset = load("seq", url, cache_dir=tmp_path / "c", storage_options=options)
    assert same(batches(loader(dataset, workers=0)), batches(loader(load("seq", local))))
    assert spoiled and dataset.store.cache_stats()["refetched"] == 1


@pytest.mark.parametrize("after", [0, 700])  # closed at once, or a reply cut in its body
def test_dropped_connections_are_retried_and_counted(datasets, proxy, tmp_path, after):
    local, url = datasets["sft"]
    proxy.after = after
    proxy.dropping.set()
    through = {"endpoint_url": proxy.url}
    retries = remote_module.STATS.retries
    dataset = load("sft", url, cache_dir=tmp_path / "c", storage_options=through)
    got = batches(loader(dataset, workers=0))
    assert same(got, batches(loader(load("sft", local))))
    assert proxy.dropped > 0
    assert remote_module.STATS.retries > retries
    assert dataset.store.cache_stats()["remote_retries"] > 0


def test_a_cache_removed_or_rewritten_under_a_running_job(datasets, options, tmp_path):
    local, url = datasets["sft"]
    expected = batches(loader(load("sft", local)))
    cache = tmp_path / "cache"
    dataset = load("sft", url, cache_dir=cache, storage_options=options)
    dataset.store.max_open_shards = 2  # shards are opened again, from the cache, often
    it = iter(loader(dataset, workers=0))
    got = [next(it) for _ in range(10)]
    while cache.exists():  # removed under the job (while its fill thread may be writing)
        shutil.rmtree(cache, ignore_errors=True)
    got += [next(it) for _ in range(5)]
    for path in cache.rglob("sequence.bin"):  # replaced by another process: same size
        junk = np.random.default_rng(0).integers(0, 9, path.stat().st_size, np.uint8)
        aside = path.with_name("junk")
        aside.write_bytes(junk.tobytes())
        os.replace(aside, path)
    filler = cache / "other-dataset" / "shards" / "x"  # another process's files
    filler.mkdir(parents=True)
    (filler / "junk.bin").write_bytes(b"\0" * 1000)
    got += list(it)
    assert same(got, expected)
    assert dataset.store.cache_stats()["rechecked"] > 0


def test_a_dataset_without_its_manifest_is_refused(datasets, options, bucket, tmp_path):
    local, _ = datasets["seq"]
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
    fs.put(str(local) + "/", f"{bucket}/seq/", recursive=True)
    fs.rm(f"{bucket}/seq/manifest.json")
    with pytest.raises(FileNotFoundError, match="manifest.json: not found"):
        load("seq", f"s3://{bucket}/seq", cache_dir=tmp_path, storage_options=options)
    with pytest.raises(ValueError, match="are for a dataset at a URL"):
        load("seq", local, cache_dir=tmp_path)
