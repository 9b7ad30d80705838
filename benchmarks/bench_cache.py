"""The machine's shard cache: what one download's eviction costs as the cache grows, and what
one cache per machine saves in downloads.

- Eviction per download: a cache folder holding n shards (n = 1e2, 1e3, 1e4; tiny files,
  made by hand and indexed), full: each download evicts one shard. Timed: the index's
  `reserve` (choose, lock, move away and delete the victim, reserve the bytes), median of
  `downloads` downloads; next to it the walk the cache did before its index (every shard
  folder listed and sorted by last use: `eviction.usage`). Floor: the index at 1e2 shards, in
  the same run; the goal is a ratio of 1 (independent of the count).
- Bytes downloaded per machine: `shards` shards in moto's S3 server (a process of its own, on
  loopback), read by 4 spawned processes, each through ShardCache.open, every shard in the
  same shuffled order (as ranks reading one shard-aware order), with a cache limit of a tenth
  of the dataset: all 4 sharing one cache folder, or each its own (4 private caches of a tenth
  each). Floor: the dataset's bytes (every shard fetched once), in the same run.
Run: python benchmarks/bench_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_remote import start_server  # noqa: E402

from tokenmill.shards.manifest import write_manifest  # noqa: E402
from tokenmill.shards.reader import read_meta  # noqa: E402
from tokenmill.shards.writer import ShardWriter  # noqa: E402
from tokenmill.storage import eviction  # noqa: E402
from tokenmill.storage.cache import ShardCache  # noqa: E402
from tokenmill.storage.eviction import CacheIndex  # noqa: E402
from tokenmill.storage.remote import Remote  # noqa: E402

SIZE = 64  # bytes of a hand-made shard


def fill(root: Path, n: int) -> Path:
    """A cache folder of n tiny shards, used in order."""
    dataset = root / "data-0"
    for i in range(n):
        folder = dataset / "shards" / f"s{i:06d}"
        folder.mkdir(parents=True)
        (folder / "sequence.bin").write_bytes(b"x" * SIZE)
        (folder / ".checked").write_text("{}")
        os.utime(folder, (1000 + i, 1000 + i))
    return dataset


def eviction_costs(root: Path, n: int, downloads: int) -> tuple[float, float]:
    """(median s per download with the index, median s of the walk before it) at n shards."""
    dataset = fill(root, n)
    index = CacheIndex(root)
    index.totals()  # indexed from one walk (a cache made before its index)
    walks = []
    for _ in range(min(downloads, 20)):
        start = time.perf_counter()
        sorted(eviction.usage(root))
        walks.append(time.perf_counter() - start)
    costs = []
    for i in range(downloads):
        rel = f"new{i:06d}"
        start = time.perf_counter()
        evicted, state = index.reserve(dataset, rel, SIZE, n * SIZE)
        costs.append(time.perf_counter() - start)
        assert state == "fits" and len(evicted) == 1, (state, evicted)
        folder = dataset / "shards" / rel
        folder.mkdir(parents=True)
        (folder / "sequence.bin").write_bytes(b"x" * SIZE)
        index.landed(dataset, rel, time.time())
    return statistics.median(costs), statistics.median(walks)


def write_dataset(root: Path, shards: int, tokens: int) -> Path:
    rng = np.random.default_rng(0)
    with ShardWriter(root, {"sequence": "int32"}, "sequence", max_tokens_per_shard=tokens) as w:
        for _ in range(shards):
            w.add({"sequence": rng.integers(0, 150_000, tokens, dtype=np.int32)})
    keys = {"sequence": "int32"}
    manifest = {"keys": keys, "primary_key": "sequence", "storage_format": "bin"}
    write_manifest(root, {**manifest, "domains": {"": w.published}})
    return root


def read_all(
    url: str, endpoint: str, cache: str, limit: int, local: str, seed: int, start: Any
) -> int:
    """A spawned process's work: every shard opened through the cache, in one shuffled order
    (the same in every process), started with the others (`start`, a barrier); the bytes it
    downloaded."""
    remote = Remote(url, {"endpoint_url": endpoint})
    shard_cache = ShardCache(remote, remote.cat("manifest.json"), cache, limit)
    folders = sorted(p.parent for p in Path(local).glob("shard_*/meta.json"))
    order = np.random.default_rng(seed).permutation(len(folders))
    start.wait()
    for s in order:
        columns = shard_cache.open(folders[s].name, read_meta(folders[s]))
        int(columns["sequence"].values[-1])
    return shard_cache.counts.counts["download_bytes"]


def machine_bytes(work: Path, shards: int, tokens: int) -> dict[str, float]:
    local = write_dataset(work / "data", shards, tokens)
    data = sum(p.stat().st_size for p in local.rglob("*") if p.parent != local)
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(key, value)  # moto's; the spawned processes inherit them
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server, endpoint = start_server()
    try:
        url = "s3://bench/data"
        remote = Remote(url, {"endpoint_url": endpoint})
        remote.fs.mkdir("bench")
        for folder in sorted(p for p in local.iterdir() if p.is_dir()):
            remote.upload_shard(folder, folder.name)
        remote.put([(local / "manifest.json", "manifest.json")])
        limit = data // 10
        out = {}
        spawn = get_context("spawn")
        for name, caches in (("shared", ["c"] * 4), ("private", ["p0", "p1", "p2", "p3"])):
            with spawn.Manager() as manager, ProcessPoolExecutor(4, mp_context=spawn) as pool:
                start = manager.Barrier(4)
                runs = [
                    pool.submit(
                        read_all, url, endpoint, str(work / name / c), limit, str(local), 7, start
                    )
                    for c in caches
                ]
                out[name] = sum(run.result() for run in runs)
        out["data"] = data
        return out
    finally:
        server.terminate()
        server.wait()


def main(quick: bool = False, downloads: int = 200, shards: int = 40) -> dict[str, float]:
    counts = (100, 1_000, 10_000)
    downloads = 50 if quick else downloads
    shards, tokens = (20, 50_000) if quick else (shards, 100_000)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_cache_") as tmp:
        for n in counts:
            rows.append((n, *eviction_costs(Path(tmp) / f"c{n}", n, downloads)))
        moved = machine_bytes(Path(tmp) / "remote", shards, tokens)
    floor = rows[0][1]
    print(f"eviction per download (full cache), median of {downloads}; floor: index at 1e2")
    print(
        f"{'shards':>8} {'index ms':>9} {'x floor':>8} | {'walk ms (before)':>16} {'walk/index':>10}"
    )
    figures: dict[str, float] = {}
    for n, new, walk in rows:
        print(
            f"{n:>8} {new * 1e3:>9.3f} {new / floor:>8.2f} | {walk * 1e3:>16.3f} {walk / new:>10.1f}"
        )
        figures[f"evict_ms_{n}"] = round(new * 1e3, 3)
        figures[f"evict_x_floor_{n}"] = round(new / floor, 2)
    data = moved["data"]
    print(
        f"\nbytes downloaded by 4 processes, every shard in one order, cache limit a tenth "
        f"of the data ({shards} shards, {data / 1e6:.1f} MB); floor: the data once"
    )
    print(f"{'caches':>10} {'MB':>8} {'x floor':>8}")
    for name in ("shared", "private"):
        print(f"{name:>10} {moved[name] / 1e6:>8.1f} {moved[name] / data:>8.2f}")
    print(f"shared / private: {moved['shared'] / moved['private']:.2f}")
    figures["shared_x_floor"] = round(moved["shared"] / data, 2)
    figures["private_x_floor"] = round(moved["private"] / data, 2)
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--downloads", type=int, default=200)
    parser.add_argument("--shards", type=int, default=40)
    args = parser.parse_args()
    print(json.dumps(main(args.quick, args.downloads, args.shards)))
