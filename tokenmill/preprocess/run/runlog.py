"""What a preprocessing run did (Summary), the folder that lets it resume (RunFolder), and
the output's lock.

Beside pipeline.py: each task that ends writes its record (run/task_output.py); after a
crash, the records say which tasks are done (kept, their counts restored in task order);
every other task is done again from its start, rewriting its own shards, so a resumed run
ends byte-identical to a clean run.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tokenmill.preprocess.ledger import Ledger
from tokenmill.shards.files import locked, write_atomic
from tokenmill.shards.format import RUN_DIR

FIRST_ERRORS_PER_REASON = 5


@dataclass
class Summary:
    """Counts of one run and its ledger (in total and per domain); printed by the CLI and stored
    in the manifest. `tokens` are the tokens written; `skipped` counts dropped records by the
    reason their RecordError gives."""

    records_read: int = 0
    records_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    first_errors: dict[str, list[str]] = field(default_factory=dict)
    rows: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    dropped_tokens: int = 0
    shards: int = 0
    seconds: float = 0.0
    tokens_read: int = 0
    dropped: dict[str, dict[str, int]] = field(default_factory=dict)
    domains: dict[str, dict[str, Any]] = field(default_factory=dict)  # domain -> its ledger

    def count_error(self, reason: str, text: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        first = self.first_errors.setdefault(reason, [])
        if len(first) < FIRST_ERRORS_PER_REASON:
            first.append(text)

    def add_counts(self, counts: dict[str, Any]) -> None:
        """Adds one task's counts (as its record keeps them) to the run's."""
        for name in ("records_read", "records_written", "rows", "tokens", "trained_tokens"):
            setattr(self, name, getattr(self, name) + counts[name])
        total = self.ledger()
        for domain, data in counts["ledgers"].items():
            ledger = Ledger.from_dict(self.domains[domain]) if domain in self.domains else Ledger()
            ledger.add(Ledger.from_dict(data))
            self.domains[domain] = ledger.as_dict()
            total.add(Ledger.from_dict(data))
        self.tokens_read, self.dropped = total.tokens_read, total.as_dict()["dropped"]
        self.dropped_tokens = total.dropped_tokens

    def ledger(self) -> Ledger:
        """The run's ledger in total."""
        ledger = Ledger(self.records_read, self.records_written, self.tokens_read, self.tokens)
        for reason, entry in self.dropped.items():
            ledger.drop(reason, entry["records"], entry["tokens"])
        return ledger

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def format(self) -> str:
        rate = self.tokens / self.seconds if self.seconds else 0.0
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        share = f"  ({self.trained_tokens / self.tokens:.1%})" if self.tokens else ""
        lines = [
            f"records read     {self.records_read:>12,}",
            f"records written  {self.records_written:>12,}",
            f"records skipped  {skipped:>12,}" + (f"  ({reasons})" if reasons else ""),
            f"rows             {self.rows:>12,}",
            *self.ledger().format(),
            f"trained tokens   {self.trained_tokens:>12,}{share}",
            f"shards           {self.shards:>12,}",
            f"seconds          {self.seconds:>12.2f}  ({rate:,.0f} tokens/s)",
        ]
        if len(self.domains) > 1:
            for domain, data in sorted(self.domains.items()):
                lines.append(f"domain {domain or '(none)'}:")
                lines += Ledger.from_dict(data).format(indent="  ")
        for reason, msgs in sorted(self.first_errors.items()):
            lines += [f"  {reason}: {m}" for m in msgs]
        return "\n".join(lines)


class RunFolder:
    """OUT/.tokenmill-run/: the run's identity (its id, then its inputs), the records of its
    tasks done (run/task_output.py) and its rejects as they are ordered; removed when the
    manifest lands. What a resume reads: O(tasks), never a per-chunk log."""

    def __init__(self, output_dir: Path, run_id: str, inputs: list[list] | None = None):
        self.dir = Path(output_dir) / RUN_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "run_id"
        if not id_file.exists():  # run_id first: a kill before inputs.json still resumes
            write_atomic(id_file, run_id.encode())
            write_atomic(self.dir / "inputs.json", orjson.dumps(inputs or []))

    @staticmethod
    def never_started(output_dir: Path) -> bool:
        """An output holding only a run folder without its run_id: a run killed before it
        wrote anything, which nothing can resume."""
        out, state = Path(output_dir), Path(output_dir) / RUN_DIR
        if not state.is_dir() or (state / "run_id").exists():
            return False
        return all(p == state for p in out.iterdir())

    @staticmethod
    def run_id_of(output_dir: Path) -> str | None:
        path = Path(output_dir) / RUN_DIR / "run_id"
        return path.read_text() if path.exists() else None

    @staticmethod
    def changed_inputs(output_dir: Path, inputs: list[list]) -> list[str]:
        """What differs between the inputs (path, bytes, stamp) of the interrupted run in
        output_dir and `inputs`, in words; [] if that run left no list."""
        path = Path(output_dir) / RUN_DIR / "inputs.json"
        if not path.exists():
            return []
        before = {row[0]: row[1:] for row in orjson.loads(path.read_bytes())}
        now = {row[0]: row[1:] for row in inputs}
        changed = [
            f"{name} changed since (bytes {before[name][0]} -> {now[name][0]}, stamp "
            f"{before[name][1]} -> {now[name][1]})"
            for name in now
            if name in before and before[name] != now[name]
        ]
        changed += [f"{name} is new" for name in now if name not in before]
        changed += [f"{name} is gone" for name in before if name not in now]
        return changed or ["same inputs; the config, tokenizer or --on-error differ"]

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def reject_line(err: dict[str, Any]) -> bytes:
    """A bad record's line in rejects.jsonl, from its entry in a task's record."""
    fields = ("source", "line", "field", "reason", "message")
    return orjson.dumps({k: err[k] for k in fields}) + b"\n"


class OutputNotWritable(PermissionError):
    """The output's folder (or the one holding it) cannot be written: read-only, no rights."""


@contextlib.contextmanager
def output_lock(output_dir: Path) -> Iterator[None]:
    """Held for a whole run, beside the output (`.NAME.tokenmill-lock`): a second run of the same
    output is refused, naming the live run that holds it (pid, host, start); the kernel drops
    the lock when that run dies, however it dies, so a dead run's lock is simply taken over."""
    path = output_dir.parent / f".{output_dir.name}.tokenmill-lock"
    with contextlib.ExitStack() as held:
        try:
            fd = held.enter_context(locked(path, wait=False, mode=0o644))
        except BlockingIOError:
            raise FileExistsError(
                f"{output_dir}: another run is writing this output ({_holder(path)}); wait for "
                f"it to finish or stop it, then run again (its lock, {path}, is a file lock "
                f"held by a live process: `fuser {path}` names it; the kernel releases it "
                "when that process ends, however it ends; removing the file releases nothing)"
            ) from None
        except OSError as err:
            if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise OutputNotWritable(
                    f"{output_dir}: cannot write there ({err.strerror}: its lock {path.name} "
                    "cannot be made beside it); choose a folder you can write to"
                ) from None
            raise
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        holder = f"pid {os.getpid()} on {socket.gethostname()}, started {started}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        yield


def _holder(lock: Path) -> str:
    """Who holds an output's lock, as its holder wrote it in the lock file ("pid P on HOST,
    started T"); anything else there (not written by tokenmill) names an unknown holder."""
    try:
        with open(lock, "rb") as f:
            data = f.read(4096)
    except OSError:
        return "a starting run"
    text = data.decode(errors="replace").strip()
    if not text:
        return "a starting run"
    if re.fullmatch(r"pid \d+ on \S+, started \S+", text):
        return text
    return f"an unknown process: the lock file holds {len(data)} bytes that name no tokenmill run"
