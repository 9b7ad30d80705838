"""What a preprocessing run did (Summary) and how to pick it up after a crash (Journal).

Beside pipeline.py: the pipeline appends one journal line per chunk it consumes,
before any of that chunk's rows can reach a shard. After a crash, the published
shards plus the journal say which chunks are fully on disk (skipped on resume,
their counts restored) and how many rows of the next chunk to skip, so a resumed
run reuses complete shards and ends byte-identical to a clean run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tokenmill.preprocess.ledger import Ledger
from tokenmill.shards.files import locked, write_atomic
from tokenmill.shards.format import RUN_DIR, TMP_MARK, checksum, row_tokens, shard_records
from tokenmill.shards.reader import find_shards, read_meta

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
        """Adds one chunk's counts (as the journal keeps them) to the run's."""
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


@dataclass
class ResumeState:
    chunks_done: int = 0
    summary: Summary = field(default_factory=Summary)
    rejects: list[bytes] = field(default_factory=list)
    published: dict[str, list[dict]] = field(default_factory=dict)
    skip_rows: dict[str, int] = field(default_factory=dict)

    def add_error(self, err: dict[str, Any]) -> None:
        """Counts a dropped record (as the journal keeps it) and lists it for rejects.jsonl."""
        self.summary.count_error(err["reason"], err["text"])
        fields = ("source", "line", "field", "reason", "message")
        self.rejects.append(orjson.dumps({k: err[k] for k in fields}) + b"\n")


class Journal:
    """Append-only log of consumed chunks in OUT/.tokenmill-run/, removed when the manifest lands."""

    def __init__(self, output_dir: Path, run_id: str, inputs: list[list] | None = None):
        self.dir = Path(output_dir) / RUN_DIR
        self.path = self.dir / "journal.jsonl"
        self.dir.mkdir(parents=True, exist_ok=True)
        id_file = self.dir / "run_id"
        if not id_file.exists():  # run_id first: a kill before inputs.json still resumes
            write_atomic(id_file, run_id.encode())
            write_atomic(self.dir / "inputs.json", orjson.dumps(inputs or []))
        self._file = open(self.path, "ab")

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

    def append(
        self, chunk: int, rows: dict[str, int], counts: dict[str, Any], errors: list[dict]
    ) -> None:
        line = {"chunk": chunk, "rows": rows, "counts": counts, "errors": errors}
        self._file.write(orjson.dumps(line) + b"\n")
        self._file.flush()

    def remove(self) -> None:
        self._file.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def resume(
        self,
        output_dir: Path,
        primary: str,
        published: Callable[[str, str], list[dict]] | None = None,
    ) -> ResumeState:
        """State to continue from: chunks fully on disk, their counts, rows of the next chunk
        to skip. `published(domain, primary)` gives a domain's published shard infos (default:
        the shards in its folder below output_dir; a bucket's for output to object storage)."""
        entries = self._entries()
        state = ResumeState()
        if not entries:
            return state
        domains = sorted({d for e in entries for d in e["rows"]})
        root = Path(output_dir)
        on_disk = {
            d: published(d, primary)
            if published is not None
            else published_shards(root / d if d else root, primary)
            for d in domains
        }
        rows = {d: sum(info["records"] for info in infos) for d, infos in on_disk.items()}
        cum = dict.fromkeys(domains, 0)
        done = 0
        for entry in entries:
            after = {d: cum[d] + entry["rows"].get(d, 0) for d in domains}
            if any(after[d] > rows[d] for d in domains):
                break
            cum = after
            done += 1
            _replay(state, entry)
        state.chunks_done = done
        state.published = {d: infos for d, infos in on_disk.items() if infos}
        state.skip_rows = {d: rows[d] - cum[d] for d in domains if rows[d] > cum[d]}
        total = {d: sum(e["rows"].get(d, 0) for e in entries) for d in domains}
        if any(rows[d] > total[d] for d in domains):
            raise ValueError(
                f"{output_dir}: shards hold more rows than the run journal knows; "
                "cannot resume, pass --overwrite to start again"
            )
        # keep only the journal lines of chunks that will not be processed again
        self._file.close()
        # a crash here leaves the old journal, never half of one
        write_atomic(self.path, b"".join(orjson.dumps(e) + b"\n" for e in entries[:done]))
        self._file = open(self.path, "ab")
        return state

    def _entries(self) -> list[dict]:
        entries = []
        for raw in self.path.read_bytes().splitlines():
            try:
                entries.append(orjson.loads(raw))
            except orjson.JSONDecodeError:
                break  # a line torn by the crash: that chunk is simply processed again
        return [e for i, e in enumerate(entries) if e["chunk"] == i]


def _replay(state: ResumeState, entry: dict) -> None:
    state.summary.add_counts(entry["counts"])
    for err in entry["errors"]:
        state.add_error(err)


def published_shards(domain_dir: Path, primary: str) -> list[dict]:
    """Infos of the shards (or JSONL parts) already published in one domain folder; temp leftovers removed."""
    if not domain_dir.is_dir():
        return []
    for tmp in domain_dir.glob(f"*{TMP_MARK}*"):
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    infos = []
    for shard in find_shards(domain_dir):
        if shard.parent != domain_dir:
            continue
        read_meta(shard)  # checked
        infos.append(shard_info(shard.name, (shard / "meta.json").read_bytes(), primary))
    for part in sorted(domain_dir.glob("part_*.jsonl")):
        infos.append(part_info(part.name, part.read_bytes(), primary))
    return infos


def shard_info(name: str, meta_bytes: bytes, primary: str) -> dict:
    """A published shard's manifest entry, from its meta.json."""
    meta = orjson.loads(meta_bytes)
    return {
        "name": name,
        "records": shard_records(meta),
        "tokens": meta[primary]["shape"][0],
        "keys": list(meta),
        "meta_xxh64": checksum(meta_bytes),
    }


def part_info(name: str, data: bytes, primary: str) -> dict:
    """A published JSONL part's manifest entry, from its bytes."""
    lines = data.splitlines()
    return {
        "name": name,
        "records": len(lines),
        "tokens": sum(row_tokens(orjson.loads(line)[primary]) for line in lines),
        "keys": list(orjson.loads(lines[0])) if lines else [],
        "nbytes": len(data),
        "xxh64": checksum(data),
    }


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
                "it to finish or stop it, then run again"
            ) from None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        holder = f"pid {os.getpid()} on {socket.gethostname()}, started {started}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        yield


def _holder(lock: Path) -> str:
    """Who holds an output's lock, as its holder wrote it in the lock file."""
    try:
        with open(lock, "rb") as f:
            return f.read(4096).decode(errors="replace").strip() or "a starting run"
    except OSError:
        return "a starting run"
