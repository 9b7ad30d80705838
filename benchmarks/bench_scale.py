"""Will the Ray engine scale? Unit costs measured on a local cluster of several raylets, and a
projection from them to 10 TB of text on 100 nodes of 32 cores.

Measured in one run, on this machine (a Ray cluster of `raylets` raylets, one CPU each, made
with ray.cluster_utils.Cluster, as several nodes would be):
- throughput: the whole Pipeline (read, tokenize, pack, write shards) over plain text (the
  shipped C4 sample repeated), Ray engine against the local engine, over pairs of rounds
  (local, Ray, Ray, local: a drift of the host's speed weighs on both);
- the tokenize-only floor: `Tokenizer.encode_batch` over the same texts on one thread, bytes
  per second per core (what no pipeline can beat);
- driver CPU: the driver process's CPU time against the Ray workers' (every `ray::` process's
  CPU time, read with psutil before and after), per task and per chunk, on a run of about
  10,000 chunks;
- driver memory: the driver's peak resident memory (RSS, sampled) during whole runs of 1e5 and 1e6
  short synthetic records (1e7 with --records ... 10000000, about 7 minutes here);
- bytes to the driver: the tasks' records (JSON) against the output's bytes; no task reads
  another's output (each writes its own shards), so bytes re-pulled by a second task are 0
  by construction.
Projected (on paper, from the figures above): 10 TB on 100 nodes of 32 cores, in tasks of
`task_bytes`: the work over 3,200 cores at the measured per-core rate (times the measured
Ray/local ratio), plus one task's time (the last wave's tail), against the tokenize-only
bound; the driver's CPU for that many tasks at the measured cost per task.
Run: python benchmarks/bench_scale.py [--records 100000 1000000] [--raylets 2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

from tokenmill.preprocess.chat.tokenizer import empty_word_cache, load_tokenizer
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"
SAMPLE = ROOT / "data" / "pretrain_c4_300.jsonl"
CLUSTER_BYTES, CLUSTER_CORES = 10 * 10**12, 100 * 32


def config(batch_size: int = 256, task_bytes: int = 128 << 20, min_chars: int = 50):
    data = default_config("seq").model_dump(mode="json")
    data["preprocessing"].update(batch_size=batch_size, task_bytes=task_bytes, min_chars=min_chars)
    return PipelineConfig.from_dict(data)


def text_corpus(folder: Path, copies: int) -> Path:
    path = folder / "c4.jsonl"
    path.write_bytes(SAMPLE.read_bytes() * copies)
    return path


def short_records(folder: Path, records: int) -> Path:
    path = folder / f"short_{records}.jsonl"
    with open(path, "wb") as f:
        for start in range(0, records, 100_000):
            f.write(
                b"".join(
                    orjson.dumps({"text": f"record {i} of the synthetic corpus"}) + b"\n"
                    for i in range(start, min(records, start + 100_000))
                )
            )
    return path


class PeakRss:
    """The driver's resident memory, sampled every 10 ms on a thread: `growth` is its peak
    over what it was when the block began (so what the run added: plans, records, buffers)."""

    def __enter__(self) -> PeakRss:
        import psutil

        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.growth = self.peak - self.start


def ray_worker_cpu() -> float:
    """CPU seconds of every Ray worker process now alive (`ray::...`)."""
    import psutil

    total = 0.0
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if line.startswith("ray::") or (proc.info["name"] or "").startswith("ray::"):
                times = proc.cpu_times()
                total += times.user + times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def run(cfg, src: Path, out: Path, engine: str, workers: int) -> dict[str, float]:
    """One whole Pipeline run: seconds, tokens, input bytes, the driver's CPU and the Ray
    workers' CPU (Ray only), the driver's peak memory growth, tasks and chunks."""
    workers_before = ray_worker_cpu() if engine == "ray" else 0.0
    pipeline = Pipeline(cfg, [src], out, TOKENIZER, workers=workers, engine=engine)
    received = [0]  # bytes of the tasks' records, as the driver gets them
    running = [0.0]  # the driver's CPU while the tasks run: its bookkeeping
    run_tasks = pipeline._engine.run_tasks

    def counted(*args, **kwargs):
        start = time.thread_time()  # this thread: the engine's submissions and the merge
        for record in run_tasks(*args, **kwargs):
            received[0] += len(orjson.dumps(record))
            running[0] = time.thread_time() - start
            yield record

    pipeline._engine.run_tasks = counted  # type: ignore[method-assign]
    with PeakRss() as rss:
        cpu, wall = time.process_time(), time.perf_counter()
        summary = pipeline.run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = rss.growth
    manifest = json.loads((out / "manifest.json").read_text())
    names = {info["name"].split("_")[1] for infos in manifest["domains"].values() for info in infos}
    output = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "seconds": wall,
        "tokens": summary.tokens,
        "bytes": src.stat().st_size,
        "driver_cpu": cpu,
        "workers_cpu": ray_worker_cpu() - workers_before if engine == "ray" else 0.0,
        "peak_rss": peak,
        "tasks": max(len(names), 1),
        "chunks": -(-summary.records_read // cfg.preprocessing.batch_size),
        "output": output,
        "received": received[0],
        "bookkeeping_cpu": running[0],
    }


def tokenize_floor(src: Path) -> float:
    """Input bytes per second of `encode_batch` over the corpus's texts, on every core of this
    machine (Rust threads), from an empty word cache as the pipeline's run starts: the
    tokenize-only floor, where no pipeline step but the tokenizer's runs."""
    texts = [orjson.loads(line)["text"] for line in src.read_bytes().splitlines()]
    tokenizer = load_tokenizer(TOKENIZER).tokenizer
    empty_word_cache(tokenizer)
    start = time.perf_counter()
    tokenizer.encode_batch(texts, add_special_tokens=False)
    return src.stat().st_size / (time.perf_counter() - start)


def main(
    records: tuple[int, ...] = (100_000, 1_000_000),
    raylets: int = 2,
    repeats: int = 2,
    copies: int = 20,
) -> dict[str, float]:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(raylets - 1):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    workers = raylets
    figures: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            text = text_corpus(folder, copies)
            # tasks of a twentieth of the corpus, as a 10 TB corpus has many of them
            text_cfg = config(task_bytes=text.stat().st_size // 20 + 1)
            for engine in ("local", "ray"):  # untimed: workers start, tokenizers load
                run(text_cfg, text, folder / f"warm-{engine}", engine, workers)
            rounds: dict[str, list[dict]] = {"local": [], "ray": []}
            floors = []
            for i in range(2 * repeats):
                for engine in ("local", "ray") if i % 2 == 0 else ("ray", "local"):
                    out = folder / f"{engine}{i}"
                    rounds[engine].append(run(text_cfg, text, out, engine, workers))
                floors.append(tokenize_floor(text))
            pairs = []
            for j in range(0, 2 * repeats, 2):
                local, ray_ = rounds["local"][j : j + 2], rounds["ray"][j : j + 2]
                pairs.append(
                    sum(r["tokens"] for r in ray_)
                    / sum(r["seconds"] for r in ray_)
                    / (sum(r["tokens"] for r in local) / sum(r["seconds"] for r in local))
                )
            ratio = statistics.median(pairs)
            local_rate = statistics.median(r["bytes"] / r["seconds"] for r in rounds["local"])
            floor_rate = statistics.median(floors)
            cores = os.cpu_count() or 1
            per_core, floor = local_rate / cores, floor_rate / cores  # bytes/s per core

            # driver CPU against the workers', at about 10,000 chunks of 16 short records
            short = short_records(folder, 160_000)
            chunky = config(batch_size=16, task_bytes=short.stat().st_size // 40 + 1, min_chars=1)
            busy = run(chunky, short, folder / "chunky", "ray", workers)

            peaks: dict[int, dict] = {}
            for n in records:
                src = short_records(folder, n)
                cfg = config(batch_size=1024, min_chars=1)
                peaks[n] = run(cfg, src, folder / f"peak{n}", "ray", workers)
                src.unlink()
    finally:
        ray.shutdown()
        cluster.shutdown()

    driver_share = busy["driver_cpu"] / max(busy["workers_cpu"], 1e-9)
    bookkeeping_share = busy["bookkeeping_cpu"] / max(busy["workers_cpu"], 1e-9)
    per_task = busy["bookkeeping_cpu"] / busy["tasks"]
    to_driver = statistics.median(r["received"] / r["output"] for r in rounds["ray"])
    task_bytes = 128 << 20
    tasks_10tb = CLUSTER_BYTES / task_bytes
    bound = CLUSTER_BYTES / (CLUSTER_CORES * floor)
    projected = CLUSTER_BYTES / (CLUSTER_CORES * per_core * ratio) + task_bytes / (2 * per_core)
    driver_10tb = tasks_10tb * per_task

    print(f"Ray engine at scale ({raylets} raylets of 1 CPU, {workers} workers; measured here)")
    print(f"{'':<44}{'value':>16}")
    print(f"{'Ray / local engine, tokens/s (median pair)':<44}{ratio:>16.2f}")
    print(f"{'  pairs (lowest-highest)':<44}{min(pairs):>8.2f}-{max(pairs):.2f}")
    print(f"{'pipeline, MB/s per core (local engine)':<44}{per_core / 1e6:>16.2f}")
    print(f"{'tokenize-only floor, MB/s per core':<44}{floor / 1e6:>16.2f}  (all cores, / {cores})")
    print(f"{'pipeline / floor':<44}{per_core / floor:>16.2f}")
    print(f"{'chunks in the driver-CPU run':<44}{busy['chunks']:>16,}")
    print(f"{'tasks in the driver-CPU run':<44}{busy['tasks']:>16,}")
    print(f"{'driver CPU, whole run, s':<44}{busy['driver_cpu']:>16.2f}")
    print(f"{'driver CPU / workers CPU, whole run':<44}{driver_share:>15.2%}")
    print(f"{'  while the tasks run (its bookkeeping)':<44}{bookkeeping_share:>15.2%}")
    print(
        f"{'driver CPU before the first task, s':<44}{busy['driver_cpu'] - busy['bookkeeping_cpu']:>16.2f}"
    )
    print(f"{'driver bookkeeping per task, ms':<44}{1e3 * per_task:>16.2f}")
    print(
        f"{'driver bookkeeping per chunk, ms':<44}{1e3 * busy['bookkeeping_cpu'] / busy['chunks']:>16.4f}"
    )
    print(f"{'bytes to the driver per output byte':<44}{to_driver:>16.5f}")
    print(f"{'bytes re-pulled by a second task':<44}{0:>16}")
    print()
    print(f"{'records':>12}{'tasks':>8}{'driver peak RSS +MB':>22}{'driver CPU s':>14}")
    for n, r in peaks.items():
        print(f"{n:>12,}{r['tasks']:>8}{r['peak_rss'] / 2**20:>22.1f}{r['driver_cpu']:>14.2f}")
    print()
    print("projected, 10 TB of text on 100 nodes x 32 cores (from the figures above):")
    print(f"  tasks of 128 MiB                        {tasks_10tb:>12,.0f}")
    print(f"  tokenize-only bound, minutes            {bound / 60:>12.1f}")
    print(f"  the Ray engine, minutes                 {projected / 60:>12.1f}")
    print(f"  engine / bound                          {projected / bound:>12.2f}")
    print(f"  driver CPU for every task, minutes      {driver_10tb / 60:>12.1f}")
    figures.update(
        {
            "ray_over_local": round(ratio, 3),
            "driver_cpu_share": round(driver_share, 5),
            "bookkeeping_cpu_share": round(bookkeeping_share, 5),
            "driver_ms_per_task": round(1e3 * per_task, 2),
            "to_driver_per_output_byte": round(to_driver, 6),
            "projection_over_bound": round(projected / bound, 3),
            "pipeline_over_floor": round(per_core / floor, 3),
            **{f"driver_rss_mb_{n}": round(r["peak_rss"] / 2**20, 2) for n, r in peaks.items()},
        }
    )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--raylets", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    sys.exit(0 if main(tuple(args.records), args.raylets, args.repeats) is not None else 1)
