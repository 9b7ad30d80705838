"""Training from object storage next to the same dataset on local disk, in the same run.

Data: `shards` shards of random int32 tokens written by the real ShardWriter, uploaded to an
S3-protocol server on loopback (moto's standalone server, in a process of its own). Each
loader is DataflowLoader over MapDistributor(SEQDataset) (2,048-token windows, batches of 8,
shuffled, `workers` DataLoader workers), reading one epoch:

- local: the dataset on local disk;
- bucket, cold: DatasetFactory.load("seq", "s3://...", cache_dir=<empty>): every shard comes
  from the server during the epoch;
- bucket, warm: the same again, every shard already in the cache.

- bucket, small cache: a shuffled epoch of another dataset (many small shards) through a
  cache half its size, with the fetches ahead of the sample order and without them
  (`training.order_prefetch.PREFETCH_POSITIONS` = 0), interleaved, each from an empty cache, through
  a proxy that holds each request LATENCY_S (a real bucket's round trip; loopback has none).

Figures: first-batch latency (from iter() to the first batch, worker start-up included) and
steady-state tokens/s (the batches after the first); local and warm are medians of 2 x
`repeats` interleaved rounds, and their ratio the median of the in-round ratios. The floor for
the cold run is the server itself: a plain parallel `get` (fsspec/s3fs, every object at once)
of the same objects in the same run, in bytes/s, next to the cold run's download rate (the
dataset's bytes over the time from the first shard bytes in the cache to the last).
Run: python benchmarks/bench_remote.py [--shards 16] [--tokens-per-shard 4000000] [--workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tokenmill.dataflow import DataflowLoader, MapDistributor
from tokenmill.shards.manifest import write_manifest
from tokenmill.shards.writer import ShardWriter
from tokenmill.storage.remote import Remote
from tokenmill.training import order_prefetch
from tokenmill.training.dataset_factory import DatasetFactory

WINDOW, BATCH = 2048, 8
WARM_ROUNDS = 2  # local and warm epochs are short and noisy: twice `repeats` rounds of both
LATENCY_S = 0.02  # a request's round trip to a bucket in the same region, for the small cache


def write_dataset(root: Path, shards: int, tokens: int) -> Path:
    rng = np.random.default_rng(0)
    with ShardWriter(root, {"sequence": "int32"}, "sequence", max_tokens_per_shard=tokens) as w:
        for _ in range(shards):
            w.add({"sequence": rng.integers(0, 150_000, tokens, dtype=np.int32)})
    write_manifest(
        root,
        {
            "keys": {"sequence": "int32"},
            "primary_key": "sequence",
            "storage_format": "bin",
            "domains": {"": w.published},
        },
    )
    return root


def start_server() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a process of its own, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start")


def epoch(dataset, workers: int) -> tuple[float, float, int]:
    """(first-batch seconds, steady-state seconds, batches after the first) of one epoch."""
    loader = DataflowLoader(
        MapDistributor(dataset, seed=0, num_epochs=1), batch_size=BATCH, num_workers=workers
    )
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    start, count = time.perf_counter(), 0
    for _ in it:
        count += 1
    return first, time.perf_counter() - start, count


def main(
    shards: int = 16,
    tokens_per_shard: int = 4_000_000,
    workers: int = 2,
    repeats: int = 3,
    quick: bool = False,
) -> dict:
    if quick:
        shards, tokens_per_shard, repeats = 8, 1_000_000, 1
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    proc, endpoint = start_server()
    work = Path(tempfile.mkdtemp(prefix="bench_remote_"))
    try:
        return run(work, endpoint, shards, tokens_per_shard, workers, repeats)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, endpoint: str, shards: int, tokens: int, workers: int, repeats: int) -> dict:
    options = {"endpoint_url": endpoint}
    local = write_dataset(work / "local", shards, tokens)
    files = sorted(p for p in local.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    url = "s3://bench/seq"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    remote = Remote(url, options)
    remote.put([(p, p.relative_to(local).as_posix()) for p in files])

    # the floor: a plain parallel get of the same objects (s3fs, all at once)
    import fsspec

    fs = fsspec.filesystem("s3", endpoint_url=endpoint, skip_instance_cache=True)
    keys = [f"bench/seq/{p.relative_to(local).as_posix()}" for p in files]
    target = work / "plain"
    target.mkdir()
    start = time.perf_counter()
    fs.get(keys, [str(target / f"{i}") for i in range(len(keys))])
    plain = size / (time.perf_counter() - start)

    def load(cache: Path | None = None):
        if cache is None:
            return DatasetFactory.load("seq", str(local), window_size=WINDOW)
        return DatasetFactory.load(
            "seq", url, window_size=WINDOW, cache_dir=cache, storage_options=options
        )

    def measure(name: str, cache: Path | None) -> dict:
        start = time.perf_counter()
        dataset = load(cache)
        loaded = time.perf_counter() - start
        first, steady, batches = epoch(dataset, workers)
        out = {
            "load_s": loaded,
            "first_batch_s": first,
            "tokens_per_s": batches * BATCH * WINDOW / steady,
        }
        if cache is not None:
            out["stats"] = dataset.store.cache_stats()
        return out

    # cold: the download phase timed from the cache folder (first bytes to the last shard)
    watch = Watch(work / "cache", sum(p.stat().st_size for p in files if p.suffix == ".bin"))
    watch.start()
    cold = measure("bucket, cold", work / "cache")
    watch.join()
    cold_bytes = size / watch.seconds
    runs: dict[str, list[dict]] = {"local": [], "bucket, warm": []}
    for _ in range(WARM_ROUNDS * repeats):  # interleaved, medians
        runs["local"].append(measure("local", None))
        runs["bucket, warm"].append(measure("bucket, warm", work / "cache"))
    warm_ratio = statistics.median(
        w["tokens_per_s"] / lo["tokens_per_s"]
        for lo, w in zip(runs["local"], runs["bucket, warm"], strict=True)
    )  # the median of in-round ratios: two epochs of a round ran under the same load
    results = {"bucket, cold": cold}
    for name, rs in runs.items():
        results[name] = {
            k: statistics.median(r[k] for r in rs)
            for k in ("load_s", "first_batch_s", "tokens_per_s")
        }

    latency = Latency(endpoint, LATENCY_S)
    try:
        small = small_cache(work, endpoint, latency.endpoint, workers, repeats)
    finally:
        latency.close()

    print(
        f"dataset: {shards} shards, {shards * tokens:,} tokens, {size / 1e6:,.0f} MB; "
        f"windows of {WINDOW}, batches of {BATCH}, {workers} workers; "
        f"local and warm: median of {WARM_ROUNDS * repeats} interleaved rounds"
    )
    print(f"{'':14} {'load s':>8} {'first batch s':>14} {'tokens/s':>14}")
    for name in ("local", "bucket, warm", "bucket, cold"):
        r = results[name]
        print(f"{name:14} {r['load_s']:8.2f} {r['first_batch_s']:14.3f} {r['tokens_per_s']:14,.0f}")
    print(
        f"plain parallel get of the objects: {plain / 1e6:,.0f} MB/s; cold run's downloads: "
        f"{cold_bytes / 1e6:,.0f} MB/s ({watch.seconds:.2f} s from first bytes to last shard)"
    )
    print(f"warm/local tokens/s: {warm_ratio:.2f} (median of in-round ratios)")
    print("cold cache counts:", json.dumps({k: v for k, v in cold["stats"].items() if v}))
    print(
        f"bucket, small cache ({small['shards']} shards of {small['shard_mb']:.2f} MB, cache "
        f"half the dataset, shuffled, {LATENCY_S * 1000:.0f} ms a request, median of {repeats}): "
        f"without fetches ahead of the order "
        f"{small['without s']:.2f} s/epoch ({small['without downloads']} downloads), with "
        f"{small['with s']:.2f} s ({small['with downloads']}): "
        f"{small['without s'] / small['with s']:.2f}x faster"
    )
    local_rate = results["local"]["tokens_per_s"]
    warm = results["bucket, warm"]
    return {
        "local tokens/s": local_rate,
        "warm tokens/s": warm["tokens_per_s"],
        "cold tokens/s": cold["tokens_per_s"],
        "local first batch s": results["local"]["first_batch_s"],
        "warm first batch s": warm["first_batch_s"],
        "cold first batch s": cold["first_batch_s"],
        "warm/local tokens/s ratio": warm_ratio,
        "cold/local tokens/s ratio": cold["tokens_per_s"] / local_rate,
        "plain get MB/s": plain / 1e6,
        "cold download MB/s": cold_bytes / 1e6,
        "cold download / plain get ratio": cold_bytes / plain,
        "small cache epoch s, no lookahead": small["without s"],
        "small cache epoch s, lookahead": small["with s"],
        "small cache lookahead speedup": small["without s"] / small["with s"],
    }


def small_cache(
    work: Path,
    endpoint: str,
    slow: str,
    workers: int,
    repeats: int,
    shards: int = 128,
    tokens: int = 32_768,
) -> dict:
    """One shuffled epoch through a cache half the dataset's size, with and without the
    fetches ahead of the sample order (interleaved, each from an empty cache), read through
    `slow` (the server behind a round trip of LATENCY_S): seconds."""
    local = write_dataset(work / "small", shards, tokens)
    files = sorted(p for p in local.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files)
    url = "s3://bench/small"
    Remote(url, {"endpoint_url": endpoint}).put(
        [(p, p.relative_to(local).as_posix()) for p in files]
    )
    options = {"endpoint_url": slow}
    saved = order_prefetch.PREFETCH_POSITIONS
    times: dict[str, list[float]] = {"without": [], "with": []}
    downloads: dict[str, int] = {}
    try:
        for r in range(repeats):
            for name, look in (("without", 0), ("with", saved)):
                order_prefetch.PREFETCH_POSITIONS = look  # forked workers inherit it
                cache = work / f"small-cache-{name}-{r}"
                dataset = DatasetFactory.load(
                    "seq",
                    url,
                    window_size=WINDOW,
                    cache_dir=cache,
                    cache_limit=size // 2,
                    storage_options=options,
                )
                start = time.perf_counter()
                epoch(dataset, workers)
                times[name].append(time.perf_counter() - start)
                downloads[name] = dataset.store.cache_stats()["downloads"]
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        order_prefetch.PREFETCH_POSITIONS = saved
    return {
        "shards": shards,
        "shard_mb": size / shards / 1e6,
        "without s": statistics.median(times["without"]),
        "with s": statistics.median(times["with"]),
        "without downloads": downloads["without"],
        "with downloads": downloads["with"],
    }


class Latency:
    """A TCP proxy on loopback that holds each request `delay` seconds before the server sees
    it: the round trip of a real bucket (tens of ms), which a server on loopback lacks."""

    def __init__(self, upstream: str, delay: float) -> None:
        host, port = upstream.rsplit("//", 1)[1].split(":")
        self.upstream, self.delay = (host, int(port)), delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self.pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self.pump, args=(server, client, False), daemon=True).start()

    def pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if delayed:  # a request (its headers come in one piece): held, then sent on
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


class Watch(threading.Thread):
    """Times the cache folder's filling: from its first shard bytes to `size` bytes."""

    def __init__(self, cache: Path, size: int) -> None:
        super().__init__(daemon=True)
        self.cache, self.size, self.seconds = cache, size, float("nan")

    def run(self) -> None:
        first = None
        deadline = time.perf_counter() + 600
        while time.perf_counter() < deadline:
            got = (
                sum(p.stat().st_size for p in self.cache.glob("*/shards/*/*.bin") if p.is_file())
                if self.cache.is_dir()
                else 0
            )
            now = time.perf_counter()
            if got and first is None:
                first = now
            if first is not None and got >= self.size:
                self.seconds = now - first
                return
            time.sleep(0.005)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--tokens-per-shard", type=int, default=4_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    main(args.shards, args.tokens_per_shard, args.workers, args.repeats, args.quick)
