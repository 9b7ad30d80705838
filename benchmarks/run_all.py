"""Runs every benchmark script's main() and writes docs/benchmarks.md from what they print.

Each script in SCRIPTS prints its own table and returns its headline figures; this runner
captures both, adds the machine and library versions, and exits non-zero if any script is
missing or fails (after writing the page, which says so).
Run: python benchmarks/run_all.py [--quick] [--only bench_store ...] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import inspect
import io
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS = (
    "bench_preprocess",
    "bench_store",
    "bench_packing",
    "bench_shuffle",
    "bench_loader",
    "bench_memory",
    "bench_run_memory",
    "bench_ray",
    "bench_scale",
    "bench_remote",
    "bench_cache",
    "bench_bucket_shuffle",
    "bench_open",
)
# Keyword arguments of each main() for --quick; a script whose main() takes `quick` gets quick=True.
QUICK = {
    "bench_preprocess": {"tokens": 1_000_000, "repeats": 1},
    "bench_packing": {"repeats": 1},
    "bench_ray": {"copies": 1, "repeats": 1},
    "bench_scale": {"records": (100_000,), "repeats": 1, "copies": 5},
    "bench_run_memory": {"input_mb": 30},
}


@dataclass
class Outcome:
    """What one script printed and returned, or why it did not run."""

    name: str
    status: str  # "ok", "missing" or "failed"
    seconds: float = 0.0
    printed: str = ""
    figures: dict = field(default_factory=dict)
    error: str = ""


class Tee(io.TextIOBase):
    """Writes to the console and keeps a copy, so a long benchmark still shows progress."""

    def __init__(self, console: io.TextIOBase):
        self.console, self.copy = console, io.StringIO()

    def write(self, text: str) -> int:
        self.console.write(text)
        return self.copy.write(text)

    def flush(self) -> None:
        self.console.flush()


def quick_options(name: str, main: object) -> dict:
    """--quick keyword arguments for `main`; says so when the script cannot take one."""
    accepted = inspect.signature(main).parameters  # type: ignore[arg-type]
    if "quick" in accepted:
        return {"quick": True}
    wanted = QUICK.get(name, {})
    ignored = sorted(set(wanted) - set(accepted))
    if ignored:
        print(f"[{name}] --quick: main() takes no {ignored}; running those at their defaults")
    return {k: v for k, v in wanted.items() if k in accepted}


def run_script(name: str, quick: bool) -> Outcome:
    if not (HERE / f"{name}.py").is_file():
        print(f"[{name}] SKIPPED: benchmarks/{name}.py is missing")
        return Outcome(name, "missing", error=f"benchmarks/{name}.py is missing")
    tee = Tee(sys.stdout)  # type: ignore[arg-type]
    start = time.perf_counter()
    try:
        module = importlib.import_module(name)
        options = quick_options(name, module.main) if quick else {}
        with contextlib.redirect_stdout(tee):
            figures = module.main(**options)
    except BaseException as err:  # a benchmark's failure is reported, never the runner's end
        if isinstance(err, KeyboardInterrupt):
            raise
        text = traceback.format_exc()
        print(f"[{name}] FAILED: {type(err).__name__}: {err}\n{text}", file=sys.stderr)
        return Outcome(
            name, "failed", time.perf_counter() - start, tee.copy.getvalue(), error=text.strip()
        )
    figures = figures if isinstance(figures, dict) else {}  # some mains only print
    return Outcome(name, "ok", time.perf_counter() - start, tee.copy.getvalue(), figures)


# --- the page -----------------------------------------------------------------------------------
def proc_field(path: str, label: str) -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(label):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def machine() -> list[str]:
    mem_kb = proc_field("/proc/meminfo", "MemTotal").split()[0]
    ram = f"{int(mem_kb) / 2**20:.1f} GiB" if mem_kb.isdigit() else "unknown"
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"CPU: {proc_field('/proc/cpuinfo', 'model name')}, {os.cpu_count()} cores ({usable} usable)",
        f"RAM: {ram}",
        f"OS: {platform.platform()}",
    ]


def versions() -> str:
    found = [f"Python {platform.python_version()}"]
    for package in ("tokenmill", "torch", "numpy", "tokenizers", "ray"):
        try:
            found.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            found.append(f"{package} not installed")
    return ", ".join(found)


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def figure(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def page(outcomes: list[Outcome], quick: bool) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python benchmarks/run_all.py"
        + (" --quick`" if quick else "`")
        + " (`make bench`); do not edit by hand.",
        "Each benchmark measures tokenmill next to a floor (the same work done the plainest",
        "fast way) in the same run; a ratio is tokenmill / floor, higher is better.",
        "",
        f"- Date: {now}" + (" (quick mode: reduced sizes and repeats)" if quick else ""),
        *[f"- {line}" for line in machine()],
        f"- Versions: {versions()}",
        f"- Commit: {git_commit()}",
        "",
        "| benchmark | status | seconds | headline ratios |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        ratios = ", ".join(f"{k} {figure(v)}" for k, v in o.figures.items() if "ratio" in k)
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | {ratios or '-'} |")
    for o in outcomes:
        lines += ["", f"## {o.name}", ""]
        if o.status == "missing":
            lines += [f"Not run: {o.error}."]
            continue
        if o.printed.strip():
            lines += ["```", o.printed.rstrip(), "```"]
        if o.figures:
            lines += ["", "| figure | value |", "|---|---|"]
            lines += [f"| {k} | {figure(v)} |" for k, v in o.figures.items()]
        if o.status == "failed":
            lines += ["", "FAILED:", "", "```", o.error, "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced sizes and repeats")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, help="run just these scripts")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(HERE), str(ROOT)]
    outcomes = []
    for name in args.only or SCRIPTS:
        print(f"=== {name}", flush=True)
        outcomes.append(run_script(name, args.quick))
        print(flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page(outcomes, args.quick))
    bad = [f"{o.name} ({o.status})" for o in outcomes if o.status != "ok"]
    print(f"wrote {args.out}")
    if bad:
        print(f"benchmarks not ok: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
