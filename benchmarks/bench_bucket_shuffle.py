"""Bytes each machine downloads per epoch from a bucket, global shuffle against shard-aware.

Data: `shards` shards of random int32 tokens (ShardWriter, indexed), uploaded to moto's S3
server on loopback and read through a proxy that holds each request LATENCY_S (a real
bucket's round trip). `machines` machines, one rank each (`dp_rank`, `dp_world_size`), each
with a cache of its own holding a tenth of the dataset (`cache_limit`), read one epoch of
2,048-token windows with DataflowLoader(MapDistributor(..., shuffle=...)), one machine after
the other (each its own cache: as on a cluster). Measured: every shard download (the cache's
own count, fetches ahead included) times the shard's size, against the machine's share of
the dataset (its bytes over `machines`); the goal for the shard-aware shuffle is at most
1.3x. The floor is that share: no order can read its samples with less.
Run: python benchmarks/bench_bucket_shuffle.py [--shards 200] [--machines 4]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import boto3
from bench_remote import LATENCY_S, Latency, start_server, write_dataset

from tokenmill.dataflow import DataflowLoader, MapDistributor
from tokenmill.shards.index import write_index
from tokenmill.storage.remote import Remote
from tokenmill.training.dataset_factory import DatasetFactory

WINDOW = 2048


def machine_epoch(url: str, options: dict, cache: Path, limit: int, rank: int, world: int, shuffle):
    """One epoch of one machine's rank: (downloads, samples read)."""
    dataset = DatasetFactory.load(
        "seq", url, window_size=WINDOW, cache_dir=cache, cache_limit=limit, storage_options=options
    )
    loader = DataflowLoader(
        MapDistributor(dataset, seed=7, num_epochs=1, shuffle=shuffle),
        batch_size=8,
        num_workers=0,
        dp_rank=rank,
        dp_world_size=world,
    )
    samples = sum(len(batch["input_ids"]) for batch in loader)
    return dataset.store.cache_stats()["downloads"], samples


def main(shards: int = 200, machines: int = 4, tokens: int = 32_768) -> dict[str, float]:
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    work = Path(tempfile.mkdtemp(prefix="tokenmill-bench-"))
    server, endpoint = start_server()
    latency = Latency(endpoint, LATENCY_S)
    try:
        local = write_dataset(work / "data", shards, tokens)
        write_index(local)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        files = sorted(p for p in local.rglob("*") if p.is_file())
        url = "s3://bench/shuffle"
        Remote(url, {"endpoint_url": endpoint}).put(
            [(p, p.relative_to(local).as_posix()) for p in files]
        )
        shard_bytes = sum(p.stat().st_size for p in files if p.parent != local) / shards
        size = shard_bytes * shards
        share = size / machines
        options = {"endpoint_url": latency.endpoint}
        rows: dict[str, list[float]] = {}
        for name, shuffle in (("global", True), ("shard-aware", "shards")):
            ratios = []
            for rank in range(machines):
                cache = work / f"cache-{name}-{rank}"
                downloads, _ = machine_epoch(
                    url, options, cache, int(size // 10), rank, machines, shuffle
                )
                ratios.append(downloads * shard_bytes / share)
                shutil.rmtree(cache, ignore_errors=True)
            rows[name] = ratios
    finally:
        latency.close()
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"downloads per machine per epoch / its share ({shards} shards of {shard_bytes / 1e3:.0f} KB,"
        f" {machines} machines, cache a tenth of the data, {LATENCY_S * 1e3:.0f} ms round trip)"
    )
    print(f"{'shuffle':<14}{'median':>8}{'lowest':>8}{'highest':>9}")
    for name, ratios in rows.items():
        print(f"{name:<14}{statistics.median(ratios):>8.2f}{min(ratios):>8.2f}{max(ratios):>9.2f}")
    return {f"{name} x share": round(statistics.median(r), 3) for name, r in rows.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shards", type=int, default=200)
    parser.add_argument("--machines", type=int, default=4)
    args = parser.parse_args()
    sys.exit(0 if main(args.shards, args.machines) else 1)
