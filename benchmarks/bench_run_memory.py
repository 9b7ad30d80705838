"""Peak memory of a whole preprocessing run, as a ratio to its input's size.

`tokenmill preprocess` runs in a fresh process on (a) pretraining text built by repeating the
shipped C4 sample to `input_mb`, at three `max_tokens_per_shard` settings, and (b) one record
of 10 MB of text, under the default config (its 10M characters pass max_chars=2M, so it is
counted as too_long before it is tokenized) and with max_chars raised past it (tokenized and
cut to max_len). Reported per run: the parent's peak RSS (VmHWM, polled), the largest
process's peak RSS (ru_maxrss of the children the run waited for), and the peak of the whole
process tree's proportional set size (PSS, polled every 50 ms, shared pages counted once),
each also as a ratio to the input's size. The goal: the parent's and each worker's memory do
not grow with `max_tokens_per_shard` (shards stream to disk) nor with the input's size.
Run: python benchmarks/bench_run_memory.py [--input-mb 300] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.presets import default_config

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "data" / "tokenizers" / "qwen2.5"
SAMPLE = ROOT / "data" / "pretrain_c4_300.jsonl"
MB = 10**6
MIB = 2**20
SHARD_TOKENS = (1_000_000, 10_000_000, 100_000_000)  # 100M is the default

WRAPPER = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.returncode)\n"
)


FLOOR = (
    "import json, resource, sys\n"
    "from tokenizers import Tokenizer\n"
    "tok = Tokenizer.from_file(sys.argv[1])\n"
    "text = json.loads(open(sys.argv[2], encoding='utf-8').readline())['text']\n"
    "tok.encode(text)\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def tree(pid: int) -> list[int]:
    """pid and its descendants, as /proc lists them now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def field_kib(path: str, name: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(name):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def measure(args: list[str], exit_code: int) -> dict[str, float]:
    """Runs `tokenmill ...` under a wrapper; peaks in MiB: parent, largest process, tree PSS.
    `exit_code`: what the run must end with (1 when it drops every record)."""
    wrapper = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, sys.executable, "-m", "tokenmill", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    parent_peak = tree_peak = 0
    start = time.perf_counter()
    while wrapper.poll() is None:
        pids = tree(wrapper.pid)[1:]  # not the wrapper itself
        if pids:
            parent_peak = max(parent_peak, field_kib(f"/proc/{pids[0]}/status", "VmHWM:"))
            pss = sum(field_kib(f"/proc/{p}/smaps_rollup", "Pss:") for p in pids)
            tree_peak = max(tree_peak, pss)
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    out = wrapper.stdout.read().split() if wrapper.stdout else []
    if wrapper.returncode or len(out) != 2 or out[1] != str(exit_code):
        raise RuntimeError(f"tokenmill {' '.join(args)} failed: {out}")
    return {
        "parent": parent_peak / 1024,
        "largest": int(out[0]) / 1024,
        "tree": tree_peak / 1024,
        "seconds": seconds,
    }


def write_config(folder: Path, name: str, shard_tokens: int | None, max_chars: int | None) -> Path:
    """The seq preset with `output.max_tokens_per_shard` and `preprocessing.max_chars` set,
    validated as a user's config file is."""
    data = default_config("seq").model_dump()
    if shard_tokens is not None:
        data["output"]["max_tokens_per_shard"] = shard_tokens
    if max_chars is not None:
        data["preprocessing"]["max_chars"] = max_chars
    path = folder / f"{name}.json"
    path.write_text(PipelineConfig.model_validate(data).model_dump_json())
    return path


def main(input_mb: int = 300, workers: int = 2) -> dict[str, float]:
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        text = folder / "text.jsonl"
        sample = SAMPLE.read_bytes()
        with open(text, "wb") as f:
            for _ in range(-(-input_mb * MB // len(sample))):
                f.write(sample)
        record = folder / "one_record.jsonl"
        words = SAMPLE.read_text().split()
        body = " ".join(words[i % len(words)] for i in range(10 * MB // 6))[: 10 * MB]
        record.write_text(json.dumps({"text": body}) + "\n")
        runs = [
            (f"text, shards of {t:,} tokens", text, (t, None), f"t{t}", 0) for t in SHARD_TOKENS
        ]
        runs += [
            ("10 MB record, default (too_long)", record, (None, None), "r_default", 1),
            ("10 MB record, max_chars=20M", record, (None, 20 * MB), "r_kept", 0),
        ]
        print(
            f"peak memory of `tokenmill preprocess` (seq preset, {workers} workers), "
            "MiB and as a ratio to the input's size"
        )
        header = f"{'run':<34} {'input MB':>9} {'parent':>8} {'largest':>8} {'tree PSS':>9} {'parent/input':>13} {'tree/input':>11} {'s':>6}"
        print(header)
        for label, path, options, key, exit_code in runs:
            config = write_config(folder, key, *options)
            out = folder / f"out_{key}"
            peaks = measure(
                [
                    "preprocess",
                    str(path),
                    "-o",
                    str(out),
                    "-c",
                    str(config),
                    "--tokenizer",
                    str(TOKENIZER),
                    "--workers",
                    str(workers),
                    "--on-error",
                    "skip",
                ],
                exit_code,
            )
            size = path.stat().st_size / MIB
            print(
                f"{label:<34} {path.stat().st_size / MB:>9.0f} {peaks['parent']:>8.0f} "
                f"{peaks['largest']:>8.0f} {peaks['tree']:>9.0f} {peaks['parent'] / size:>13.3f} "
                f"{peaks['tree'] / size:>11.3f} {peaks['seconds']:>6.0f}"
            )
            figures[f"{key} parent MiB"] = round(peaks["parent"], 1)
            figures[f"{key} largest MiB"] = round(peaks["largest"], 1)
            figures[f"{key} tree PSS MiB"] = round(peaks["tree"], 1)
            if key.startswith("r_"):
                summary = json.loads((out / "manifest.json").read_text())["summary"]
                kept = {k: summary.get(k) for k in ("records_written", "tokens")}
                print(f"{'':<34} {kept}")
            else:
                shards = len(list(out.glob("shard_*")))
                print(
                    f"{'':<34} {shards} shards, {json.loads((out / 'manifest.json').read_text())['summary'].get('tokens'):,} tokens"
                )
        floor = subprocess.run(
            [sys.executable, "-c", FLOOR, str(TOKENIZER / "tokenizer.json"), str(record)],
            capture_output=True,
            text=True,
            check=True,
        )
        floor_mib = int(floor.stdout.split()[-1]) / 1024
        figures["floor: encode of the 10 MB record MiB"] = round(floor_mib, 1)
        figures["r_kept largest / encode floor"] = round(
            figures["r_kept largest MiB"] / floor_mib, 2
        )
        print(
            f"floor: a bare process encoding the 10 MB record with `tokenizers`: {floor_mib:.0f} MiB "
            f"peak; the kept run's largest process is {figures['r_kept largest / encode floor']:.2f}x that"
        )
        spread = [figures[f"t{t} largest MiB"] for t in SHARD_TOKENS]
        figures["largest MiB, max/min over shard sizes"] = round(max(spread) / min(spread), 2)
        print(
            "largest process's peak over shard sizes 1M/10M/100M tokens: max/min = "
            f"{figures['largest MiB, max/min over shard sizes']:.2f}"
        )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-mb", type=int, default=300)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    main(**{k.replace("-", "_"): v for k, v in vars(parser.parse_args()).items()})
