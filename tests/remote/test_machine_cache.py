"""One shard cache per machine: processes sharing one cache folder (real spawned processes,
reading from moto's S3 server through a counting front on loopback) stay under its limit and
never fetch an object twice at once; eviction follows the index, never a listing of the
folder, in the documented order; a dead process's claims go with it; the look-ahead budget
is split between the machine's processes; ranged reads give the bytes of a whole-shard read."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_bucket_read import dataset_bytes, largest_shard

from tokenmill.shards.files import locked
from tokenmill.shards.reader import map_shard, read_meta
from tokenmill.storage import cache as cache_module
from tokenmill.storage import eviction
from tokenmill.storage.cache import LOOKAHEAD_SHARE, ShardCache
from tokenmill.storage.cache_files import lock_file
from tokenmill.storage.eviction import CacheIndex
from tokenmill.storage.remote import Remote

pytestmark = pytest.mark.slow  # an S3 server, spawned processes

SPAWN = multiprocessing.get_context("spawn")


# --- a front to the S3 server that counts what is fetched ------------------------------------
class Counting:
    """WSGI middleware on moto's app: per object, GETs, bytes sent and byte ranges asked;
    `overlaps` lists every GET of an object that arrived while another GET of it was still
    sending (a request counts as done before its last bytes are written: a client cannot
    have read them all before)."""

    def __init__(self, app):
        self.app, self.lock = app, threading.Lock()
        self.gets: Counter = Counter()
        self.sent: Counter = Counter()
        self.inflight: Counter = Counter()
        self.ranges: list[tuple[str, str]] = []
        self.overlaps: list[str] = []

    def reset(self) -> None:
        with self.lock:
            self.gets.clear(), self.sent.clear(), self.ranges.clear(), self.overlaps.clear()

    def __call__(self, environ, start_response):
        key = environ.get("PATH_INFO", "")
        if environ["REQUEST_METHOD"] != "GET" or environ.get("QUERY_STRING") or key.count("/") < 3:
            return self.app(environ, start_response)
        with self.lock:
            self.gets[key] += 1
            self.inflight[key] += 1
            if self.inflight[key] > 1:
                self.overlaps.append(key)
            if "HTTP_RANGE" in environ:
                self.ranges.append((key, environ["HTTP_RANGE"]))
        length: list[int] = []

        def start(status, headers, *args):
            length.extend(int(v) for k, v in headers if k.lower() == "content-length")
            return start_response(status, headers, *args)

        try:
            body = self.app(environ, start)
        except BaseException:
            self._done(key)
            raise
        return self._counted(key, body, length)

    def _done(self, key: str) -> None:
        with self.lock:
            self.inflight[key] -= 1

    def _counted(self, key, body, length) -> Iterator[bytes]:
        sent, done = 0, False
        try:
            for chunk in body:
                sent += len(chunk)
                with self.lock:
                    self.sent[key] += len(chunk)
                if not done and length and sent >= length[0]:
                    done = True
                    self._done(key)
                yield chunk
        finally:
            if hasattr(body, "close"):
                body.close()
            if not done:
                self._done(key)


@pytest.fixture(scope="module")
def counting(s3_server) -> Iterator[tuple[str, Counting]]:
    """(endpoint, counts): a second server on moto's app in this process (the same buckets
    as `s3_server`), each GET counted."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    counts = Counting(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counts, True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", counts
    finally:
        server.shutdown()
        thread.join()


def shard_objects(counts: Counting, what: Counter) -> dict[str, int]:
    """`what` (gets or sent) of the shards' data files (not meta.json, manifest, index)."""
    return {
        k: n
        for k, n in what.items()
        if "/shard_" in k and not k.endswith(("meta.json", ".index", "manifest.json"))
    }


def cached_bytes(root: Path) -> int:
    """Bytes of every shard file below the cache's shard folders (downloads under way
    included) and its trash: what the limit bounds, found by walking the folder (under the index lock:
    else a shard evicted and another landed while it walks would both be counted)."""
    total = 0
    for dataset in [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []:
        for base in (dataset / "shards", root / ".trash"):
            for folder, _, names in os.walk(base):
                for name in names:
                    if name.startswith(".checked"):
                        continue  # the cache's own notes, not shard files
                    with contextlib.suppress(FileNotFoundError):
                        total += os.path.getsize(os.path.join(folder, name))
    return total


# --- processes sharing one cache ---------------------------------------------------------------
def read_epoch(url: str, endpoint: str, cache: str, limit: int, seed: int, local: str):
    """A spawned process's work: one shuffled epoch of the dataset through the shared cache
    (every shard read from the cache, not kept mapped), its batches against a local copy's."""
    from test_bucket_read import batches, load, loader, same

    dataset = load(
        "sft", url, cache_dir=cache, cache_limit=limit, storage_options={"endpoint_url": endpoint}
    )
    dataset.store.max_open_shards = 1
    got = batches(loader(dataset, workers=0, seed=seed))
    return same(got, batches(loader(load("sft", local), workers=0, seed=seed)))


def test_processes_sharing_one_cache_stay_under_its_limit_and_never_fetch_twice_at_once(
    datasets, counting, tmp_path
):
    local, url = datasets["sft"]
    endpoint, counts = counting
    cache = tmp_path / "cache"
    limit = 6 * largest_shard(local)
    assert limit < dataset_bytes(local) // 5  # shards are evicted and fetched again
    counts.reset()
    most, stop = [0], threading.Event()

    def watch() -> None:  # the folder's bytes as often as it can be walked
        while not stop.is_set():
            with locked(cache / ".index.lock"):  # no shard lands or goes while it is walked
                most[0] = max(most[0], cached_bytes(cache))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ProcessPoolExecutor(4, mp_context=SPAWN) as pool:
            runs = [
                pool.submit(read_epoch, url, endpoint, str(cache), limit, seed, str(local))
                for seed in range(4)
            ]
            assert [run.result() for run in runs] == [True] * 4  # the local batches
    finally:
        stop.set()
        watcher.join()
    most[0] = max(most[0], cached_bytes(cache))
    remote = Remote(url, {"endpoint_url": endpoint})
    stats = ShardCache(remote, remote.cat("manifest.json"), cache, limit).stats()
    assert 0 < most[0] <= limit
    assert 0 < stats["cache_peak"] <= limit and stats["cache_reserved"] == 0
    assert stats["evictions"] > 0
    # no shard file fetched by two at once (meta.json: bucket_source's reader fetches it
    # without the cache's lock until it calls ShardCache.meta_bytes)
    assert shard_objects(counts, Counter(counts.overlaps)) == {}
    got = shard_objects(counts, counts.gets)
    shards = {p.parent.name for p in local.glob("shard_*/meta.json")}
    assert {k.rsplit("/", 2)[1] for k in got} == shards  # every shard came from the server
    assert sum(shard_objects(counts, counts.sent).values()) == stats["download_bytes"]


def claim_and_wait(root: str, dataset: str, rel: str, ready, go) -> None:
    """A spawned process's work: claims one shard, says so, waits to be let go, ends."""
    index = CacheIndex(Path(root))
    index.claim(Path(root) / dataset, {rel}, {})
    ready.set()
    go.wait()


def test_a_dead_processs_claims_go_with_it_and_the_look_ahead_is_split(tmp_path):
    root = tmp_path / "cache"
    cache = ShardCache(Remote(f"file://{tmp_path}/bucket"), b"{}", root, 10_000)
    assert cache.lookahead_budget(1.0) == 10_000 * LOOKAHEAD_SHARE  # alone on the machine
    with SPAWN.Manager() as manager:
        ready, go = manager.Event(), manager.Event()
        child = SPAWN.Process(
            target=claim_and_wait, args=(str(root), cache.dir.name, "s0", ready, go)
        )
        child.start()
        assert ready.wait(600)
        cache.keep = {"s1"}
        assert cache.index.lookers() == 2  # alive: holds its owner lock
        assert cache.lookahead_budget(1.0) == 10_000 * LOOKAHEAD_SHARE / 2
        go.set()
        child.join()
    assert child.exitcode == 0
    assert cache.index.lookers() == 1  # its lock died with it: its claims are dropped
    assert cache.lookahead_budget(1.0) == 10_000 * LOOKAHEAD_SHARE
    with cache.index.txn() as db:
        assert db.execute("SELECT owner, rel FROM claims").fetchall() == [(cache.index.owner, "s1")]


# --- eviction order, from the index --------------------------------------------------------------
def make_shards(root: Path, dataset: str, n: int, size: int) -> list[str]:
    """n shard folders of `size` bytes, as downloads leave them, used in order (mtime)."""
    rels = []
    for i in range(n):
        rel = f"shard_{i:05d}"
        folder = root / dataset / "shards" / rel
        folder.mkdir(parents=True)
        (folder / "sequence.bin").write_bytes(b"x" * size)
        (folder / ".checked").write_text("{}")
        os.utime(folder, (1000 + i, 1000 + i))
        rels.append(rel)
    return rels


@contextlib.contextmanager
def no_listing(root: Path) -> Iterator[None]:
    """Listing the cache folder, a dataset folder or its shards folder raises."""
    watched = {root, *root.iterdir(), *(p / "shards" for p in root.iterdir())}
    saved = os.scandir, os.listdir, os.walk

    def guard(call):
        def checked(path=".", *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path) in watched:
                raise AssertionError(f"{path} listed")
            return call(path, *args, **kwargs)

        return checked

    os.scandir, os.listdir, os.walk = (guard(c) for c in saved)  # type: ignore[assignment]
    try:
        yield
    finally:
        os.scandir, os.listdir, os.walk = saved  # type: ignore[assignment]


def evict_all(index: CacheIndex, dataset: Path, size: int, limit: int, n: int) -> list:
    """(dataset, shard) evicted by n downloads of `size` bytes each under way at once (into
    a full cache), in order; then the downloads end, landing nothing."""
    order = []
    for i in range(n):
        evicted, state = index.reserve(dataset, f"new_{i}", size, limit)
        assert state == "fits"
        order += evicted
    assert index.totals()["reserved"] == n * size
    for i in range(n):
        index.landed(dataset, f"new_{i}", 0.0)  # nothing landed: the reservation goes
    return order


def test_eviction_follows_last_use_and_the_claims_without_listing_the_folder(tmp_path):
    root = tmp_path / "cache"
    rels = make_shards(root, "data-1", 12, 100)
    dataset = root / "data-1"
    index = CacheIndex(root)
    index.touch(dataset, rels[2], 5000.0)  # used last: goes last of the unclaimed
    with no_listing(root):
        index.claim(dataset, keep={rels[0], rels[7]}, later={rels[1]: 0, rels[3]: 1, rels[7]: 2})
        assert index.totals()["bytes"] == 1200
        order = [rel for _, rel in evict_all(index, dataset, 100, 1200, 12)]
    unclaimed = [r for r in rels if r not in {rels[0], rels[1], rels[3], rels[7], rels[2]}]
    # unclaimed by last use; then read later, the one read last first; then kept, by last use
    assert order == [*unclaimed, rels[2], rels[3], rels[1], rels[0], rels[7]]
    assert not any((dataset / "shards" / r).exists() for r in rels)
    assert index.totals()["bytes"] == 0


def test_eviction_without_claims_picks_the_victims_of_the_walk(tmp_path):
    """Before the index: every shard walked, sorted by last use (mtime), evicted from the
    oldest. The index, made from one walk of a cache written before it, picks the same."""
    root = tmp_path / "cache"
    make_shards(root, "a-1", 30, 100)
    rels_b = make_shards(root, "b-2", 30, 100)
    for i, rel in enumerate(rels_b):  # two datasets, uses interleaved
        os.utime(root / "b-2" / "shards" / rel, (1000.5 + i, 1000.5 + i))
    walked = sorted(eviction.usage(root))  # the old order: (last use, folder, ...)
    expected = [(dataset.name, folder.name) for _, folder, dataset, _ in walked][:25]
    index = CacheIndex(root)
    assert index.totals()["bytes"] == 6000  # made from one walk (a cache older than its index)
    with no_listing(root):
        assert evict_all(index, root / "a-1", 100, 6000, 25) == expected


def test_a_shard_being_read_is_passed_over_and_the_download_waits_for_it(tmp_path):
    root = tmp_path / "cache"
    rels = make_shards(root, "data-1", 2, 100)
    dataset = root / "data-1"
    index = CacheIndex(root)
    with locked(lock_file(dataset, rels[0]), exclusive=False):  # being mapped
        evicted, state = index.reserve(dataset, "new", 100, 200)
        assert evicted == [("data-1", rels[1])] and state == "fits"
        index.landed(dataset, "new", 0.0)
        evicted, state = index.reserve(dataset, "new", 200, 200)
        assert evicted == [] and state == "wait"  # it is released soon: nothing reserved
        assert index.totals()["reserved"] == 0
    evicted, state = index.reserve(dataset, "new", 200, 200)
    assert evicted == [("data-1", rels[0])] and state == "fits"


def test_a_download_bigger_than_the_limit_passes_it_and_says_so(tmp_path):
    root = tmp_path / "cache"
    make_shards(root, "data-1", 1, 100)
    index = CacheIndex(root)
    evicted, state = index.reserve(root / "data-1", "big", 500, 200)
    assert evicted == [("data-1", "shard_00000")] and state == "over"
    assert index.totals()["peak"] == 500


# --- metadata once per machine -----------------------------------------------------------------
def fetch_metas(url: str, endpoint: str, cache: str, manifest: bytes, rels: list[str]) -> int:
    """A spawned process's work: every listed shard's meta.json through the shared cache."""
    shard_cache = ShardCache(Remote(url, {"endpoint_url": endpoint}), manifest, cache, None)
    shard_cache.metas([(rel, {}) for rel in rels])
    return sum(shard_cache.meta_bytes(rel, lambda _: True) is not None for rel in rels)


def test_metadata_is_fetched_once_per_machine(datasets, counting, tmp_path):
    local, url = datasets["sft"]
    endpoint, counts = counting
    rels = sorted(p.parent.name for p in local.glob("shard_*/meta.json"))
    manifest = (local / "manifest.json").read_bytes()
    counts.reset()
    with ProcessPoolExecutor(4, mp_context=SPAWN) as pool:
        runs = [
            pool.submit(fetch_metas, url, endpoint, str(tmp_path / "c"), manifest, rels)
            for _ in range(4)
        ]
        assert [run.result() for run in runs] == [len(rels)] * 4
    metas = {k: n for k, n in counts.gets.items() if k.endswith("/meta.json")}
    assert len(metas) == len(rels) and set(metas.values()) == {1}


# --- ranged reads ---------------------------------------------------------------------------------
def test_ranged_reads_give_the_bytes_of_a_whole_shard_read(datasets, counting, tmp_path):
    local, url = datasets["sft"]
    endpoint, counts = counting
    cache = ShardCache(
        Remote(url, {"endpoint_url": endpoint}),
        (local / "manifest.json").read_bytes(),
        tmp_path / "c",
        None,
    )
    checked = 0
    for folder in sorted(p.parent for p in local.glob("shard_*/meta.json"))[:3]:
        meta = read_meta(folder)
        whole = cache.open(folder.name, meta)  # downloaded whole, mapped
        assert {k: c.values.tobytes() for k, c in whole.items()} == {
            k: c.values.tobytes() for k, c in map_shard(folder, meta).items()
        }
        rows = len(whole["sequence"].offsets) - 1
        for begin, end in [
            (0, 1),
            (rows // 2, min(rows, rows // 2 + 3)),
            (rows - 1, rows),
            (0, rows),
        ]:
            counts.reset()
            got = cache.read_rows(folder.name, meta, list(meta), begin, end)
            for key, column in whole.items():
                offsets = column.offsets
                assert offsets is not None
                lo, hi = int(offsets[begin]), int(offsets[end])
                assert got[key].values.tobytes() == column.values[lo:hi].tobytes()
                assert np.array_equal(got[key].offsets, offsets[begin : end + 1] - lo)
                checked += 1
            values = {k: n for k, n in counts.sent.items() if k.endswith(".bin")}
            wanted = sum(c.values.nbytes + c.offsets.nbytes for c in got.values())
            assert sum(values.values()) == wanted  # just the rows' bytes, by ranges
            assert len(counts.ranges) == 2 * len(meta)
    assert checked > 0
    with pytest.raises(ValueError, match=rf"{folder.name}: rows 0\.\.100000 of key 'sequence'"):
        cache.read_rows(folder.name, meta, ["sequence"], 0, 100_000)


def test_a_ranged_read_pays_only_for_a_shard_nobody_wants_in_a_full_cache(
    datasets, tmp_path, monkeypatch
):
    monkeypatch.setattr(cache_module, "RANGE_RATIO", 2)  # the test's shards have a few rows
    local, url = datasets["sft"]
    folders = sorted(p.parent for p in local.glob("shard_*/meta.json"))
    metas = [read_meta(f) for f in folders[:2]]
    size = max(sum(p.stat().st_size for p in f.iterdir() if p.name != "meta.json") for f in folders)
    rows = len(map_shard(folders[1], metas[1])["sequence"].offsets) - 1
    root = tmp_path / "c"
    cache = ShardCache(Remote(url), (local / "manifest.json").read_bytes(), root, 10 * size)
    assert not cache.ranged_pays(folders[1].name, metas[1], 1)  # room: download it
    for rel in make_shards(root, cache.dir.name, 10, size):
        cache.index.touch(cache.dir, rel, 1.0)  # indexed (made by hand here)
    assert cache.ranged_pays(folders[1].name, metas[1], 1)  # full, and nobody reads it soon
    assert not cache.ranged_pays(folders[1].name, metas[1], rows)  # too many rows
    cache.later = {folders[1].name: 3}
    assert not cache.ranged_pays(folders[1].name, metas[1], 1)  # read soon: download it
    cache.later = {}
    shutil.rmtree(root / cache.dir.name / "shards" / "shard_00000")
    (root / cache.dir.name / "shards" / folders[1].name).mkdir()
    assert not cache.ranged_pays(folders[1].name, metas[1], 1)  # in the cache already
