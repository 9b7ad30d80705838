"""Chunks: the unit of processing, shared by the local and the Ray engine.

A task's records (engines/tasks.py) are cut into chunks of `batch_size` in input order; a
chunk is masked and packed as a whole (packing pools never cross chunks), so the rows a
chunk yields depend only on its records, never on which worker ran it.
"""

from __future__ import annotations

import re
import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenmill.preprocess.chat.template import Renderer, start_run
from tokenmill.preprocess.chat.token_offsets import added_table, encode_offsets_batch
from tokenmill.preprocess.chat.tokenizer import (
    empty_word_cache,
    encode_fast,
    load_tokenizer,
    tokenizer_threads_off,
)
from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.cleaning import kept, mapped, split_domain, split_of
from tokenmill.preprocess.document.filters import FILTER_REASONS, check_chars, raw_chars
from tokenmill.preprocess.document.masking import RecordMasker
from tokenmill.preprocess.document.parts import Premade, Rendering
from tokenmill.preprocess.document.truncation import Part
from tokenmill.preprocess.inputs.fields import get_field, get_tools, record_error
from tokenmill.preprocess.inputs.records import Record, RecordError
from tokenmill.preprocess.ledger import Ledger
from tokenmill.preprocess.packing import apply_packing, plan_packing, position_ids
from tokenmill.shards.format import RUN_DIR, TMP_MARK, is_shard_name
from tokenmill.shards.index import INDEX_NAME

_SAFE_DOMAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # so never '.'-first
# Names a dataset folder holds for itself: a domain folder by one of them breaks the dataset.
_RESERVED = frozenset({"manifest.json", "meta.json", "rejects.jsonl", INDEX_NAME, RUN_DIR})
_RESERVED_SUFFIXES = (".json", ".jsonl", ".bin", ".index")


@dataclass
class Chunk:
    """Chunk `index` of task `task`; `last`: the task's last chunk (every task has one, if
    empty, so that a task's end is seen in the stream of results). `duplicates`: records a
    dedup pre-pass took out of the chunk, in input order: counted, never tokenized."""

    task: int
    index: int
    records: list[Record] = field(default_factory=list)
    read_errors: list[RecordError] = field(default_factory=list)
    last: bool = False
    duplicates: list[Record] = field(default_factory=list)


@dataclass
class ChunkResult:
    """One chunk's output rows (domain, row), its errors and its counts."""

    task: int
    index: int
    last: bool
    records_read: int
    records_written: int
    rows: list[tuple[str, Any]]
    errors: list[RecordError]
    ledgers: dict[str, Ledger] = field(default_factory=dict)  # per domain
    trained_tokens: int = 0

    @property
    def tokens(self) -> int:
        return sum(ledger.tokens_written for ledger in self.ledgers.values())

    @property
    def dropped_tokens(self) -> int:
        return sum(ledger.dropped_tokens for ledger in self.ledgers.values())


THREADS = 2  # chunks a process works on at once: one thread encodes (no GIL) while another masks


class Maskers:
    """A masker per thread (a masker holds its chunk's texts preencoded), all on the one
    tokenizer of the process."""

    def __init__(self, config_data: dict, tokenizer_path: str):
        self.config = PipelineConfig.from_dict(config_data)
        self.bundle = load_tokenizer(tokenizer_path)
        empty_word_cache(self.bundle.tokenizer)  # a run's own words, not an earlier run's
        added_table(self.bundle.tokenizer)  # once, here: each thread's first chunk would make it
        start_run()  # the run's template budget starts whole, once per process and run
        self._local = threading.local()

    def process(self, chunk: Chunk) -> ChunkResult:
        masker = getattr(self._local, "masker", None)
        if masker is None:
            masker = self._local.masker = RecordMasker(self.config, self.bundle)
        return process_chunk(chunk, masker)


_MASKERS: Maskers | None = None
_THREADS: ThreadPoolExecutor | None = None


def setup_worker(config_data: dict, tokenizer_path: str) -> None:
    """A worker process set up for a run: its maskers (the tokenizer is loaded once per
    process), and the threads its chunks run on, started once (a Ray worker serves many runs)."""
    global _MASKERS, _THREADS
    _MASKERS = Maskers(config_data, tokenizer_path)
    if _THREADS is None:
        _THREADS = ThreadPoolExecutor(THREADS, thread_name_prefix="tokenmill-chunk")


def process_chunks(chunks: list[Chunk]) -> list[ChunkResult]:
    """A worker process's work item: up to THREADS chunks, processed at once on its threads."""
    return list(process_stream(iter(chunks)))


def process_stream(
    chunks: Iterator[Chunk],
    maskers: Maskers | None = None,
    threads: ThreadPoolExecutor | None = None,
    in_flight: int = THREADS + 1,
) -> Iterator[ChunkResult]:
    """Chunks processed on threads as they are read, results in order: up to `in_flight` at once,
    so a thread that is done takes the next chunk at once. The worker process's maskers and
    threads (`setup_worker`) unless given."""
    maskers = maskers or _MASKERS
    threads = threads or _THREADS
    if maskers is None or threads is None:
        raise RuntimeError("process_stream called before setup_worker")
    pending: deque[Future[ChunkResult]] = deque()
    try:
        for chunk in chunks:
            pending.append(threads.submit(maskers.process, chunk))
            if len(pending) >= in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:  # an error or a closed stream: nothing more
            future.cancel()


def process_here(
    chunks: Iterator[Chunk], threads: int, args: tuple[dict, str], in_flight: int | None = None
) -> Iterator[ChunkResult]:
    """Chunks processed on `threads` threads of this process; `args` = (config data, tokenizer
    path), as `setup_worker` takes them. Up to `in_flight` chunks at once (default: twice the
    threads, since this thread also writes the shards)."""
    maskers = Maskers(*args)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenmill-chunk")
    try:
        with tokenizer_threads_off():
            yield from process_stream(chunks, maskers, pool, in_flight=in_flight or 2 * threads)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an error or a closed run: no more


def preencode(masker: RecordMasker, records: list[Record]) -> dict:
    """Pretraining text (one plain text section): the chunk's texts encoded in one batch
    without character offsets (`encode_fast`; only chat masks need offsets), which costs
    about a quarter less tokenizer time than an `encode` per record, for the same ids.
    Texts past max_chars are left out: the length filter drops them before any encode."""
    config = masker.config
    sections = config.input.sections
    if config.multi_output or len(sections) != 1 or sections[0].template:
        return {}
    field = sections[0].field
    limit = config.preprocessing.max_chars
    add_special = sections[0].add_special_tokens
    texts = [
        text
        for record in records
        if isinstance(record.data, dict)
        and isinstance(text := record.data.get(field), str)
        and len(text) <= limit
    ]
    encodings = encode_fast(masker.bundle.tokenizer, texts, add_special is not False)
    return {id(text): (text, e.ids) for text, e in zip(texts, encodings, strict=True)}


PRERENDER_CHARS = 1 << 22  # prerendered per chunk, at most (and one record): about 20 MB of offsets


def prerender(
    masker: RecordMasker, records: list[Record]
) -> dict[tuple[str, int], list[Rendering]]:
    """Chats (SFT, preference pairs): the chunk's conversations rendered, and their renderings
    encoded in one batch (`encode_offsets_batch`), as the masker's part maker takes them
    (`Premade.rendering`): the masking threads hand the GIL to each other once per chunk,
    not once per conversation. A record that fails here (too long, bad messages, a template
    error) is left to its own pass, which says why."""
    config = masker.config
    sections = config.all_sections()
    generation = any(s.train_spans == "generation" for s in sections)
    if generation or not any(s.template for s in sections):
        return {}  # the template's generation blocks: rendered with the record's own pass
    if "strftime_now" in (masker.bundle.chat_template or ""):
        return {}  # a template that reads the clock renders when the record's own pass does
    made: list[tuple[tuple[str, int], Part, list[dict] | None, str]] = []
    chars = 0
    # a (source, line) names one record of a chunk: records made by hand that share one are
    # each rendered on their own
    names = Counter((record.source, record.line) for record in records)
    for record in records:
        if chars > PRERENDER_CHARS:  # the rest one at a time: long records' offsets take memory
            break
        key = (record.source, record.line)
        if names[key] > 1:
            continue
        try:
            check_chars(record, config, 0, raw_chars(record, config))
            for part in masker.conversations(record):
                section = part.section
                tools = get_tools(record, section.tools_field)
                render = Renderer(masker.bundle, tools, section.template_kwargs)
                text = render(part.messages or [], section.generation_prompt)
                made.append((key, part, tools, text))
                chars += len(text)
        except Exception:  # noqa: BLE001 - reported by the record's own pass
            continue
    offsets = encode_offsets_batch(masker.bundle, [text for *_, text in made])
    rendered: dict[tuple[str, int], list[Rendering]] = {}
    for (key, part, tools, text), encoded in zip(made, offsets, strict=True):
        rendering = (part.section, part.messages or [], tools, text, encoded)
        rendered.setdefault(key, []).append(rendering)
    return rendered


def process_chunk(chunk: Chunk, masker: RecordMasker) -> ChunkResult:
    """A chunk's rows, per domain, and its ledger: every record and token read is written or
    dropped by reason (bad records, duplicates, the filter hook, filters, truncation, packing
    overflow). Each record is mapped, placed (its split and domain: the folder its rows go
    to) and filtered before the chunk is tokenized."""
    config = masker.config
    errors = list(chunk.read_errors)
    ledgers: dict[str, Ledger] = {}
    for _ in chunk.read_errors:  # unreadable: no domain, no tokens
        _ledger(ledgers, "").records_read += 1
        _ledger(ledgers, "").drop("bad_record", 1, 0)
    for record in chunk.duplicates:  # as read: the pre-pass compared the records as read
        try:
            domain = split_domain(split_of(record, config), _domain(record, config))
        except RecordError:  # its first copy is counted bad, by name
            domain = ""
        _ledger(ledgers, domain).records_read += 1
        _ledger(ledgers, domain).drop("duplicate", 1, 0)
    todo: list[tuple[Record, str]] = []
    for record in chunk.records:
        try:
            record = mapped(record, config)
            domain = _domain(record, config)
        except RecordError as err:  # no domain to count it in
            errors.append(err)
            _ledger(ledgers, "").records_read += 1
            _ledger(ledgers, "").drop("bad_record", 1, 0)
            continue
        domain = split_domain(split_of(record, config), domain)
        ledger = _ledger(ledgers, domain)
        ledger.records_read += 1
        try:
            keep = kept(record, config)
        except RecordError as err:
            errors.append(err)
            ledger.drop("bad_record", 1, 0)
            continue
        if keep:
            todo.append((record, domain))
        else:
            ledger.drop("filtered", 1, 0)
    records = [record for record, _ in todo]
    masker.take_premade(Premade(preencode(masker, records), prerender(masker, records)))
    by_domain: dict[str, list[dict]] = {}
    for record, domain in todo:
        ledger = ledgers[domain]
        try:
            out, tally = masker.process_counted(record)
        except RecordError as err:  # a filter drops what it rendered; a bad record renders nothing
            errors.append(err)
            filtered = err.reason in FILTER_REASONS
            tokens = err.tokens if filtered else 0
            ledger.tokens_read += tokens
            ledger.drop(err.reason if filtered else "bad_record", 1, tokens)
            continue
        ledger.tokens_read += tally.tokens
        ledger.records_written += 1
        if tally.truncated:
            ledger.drop("truncated", 1, tally.truncated)
        by_domain.setdefault(domain, []).append(out)
    rows: list[tuple[str, dict]] = []
    schema = masker.layout.row_schema()
    for domain, outs in by_domain.items():
        packed, lost, cut = pack_rows(outs, config)
        if lost:
            ledgers[domain].drop("packing_overflow", cut, lost)
        ledgers[domain].tokens_written += sum(schema.token_count(row) for row in packed)
        rows.extend((domain, row) for row in packed)
    read = len(chunk.records) + len(chunk.read_errors) + len(chunk.duplicates)
    written = sum(len(v) for v in by_domain.values())
    result = ChunkResult(chunk.task, chunk.index, chunk.last, read, written, rows, errors, ledgers)
    result.trained_tokens = sum(schema.trained_tokens(row) for _, row in rows)
    return result


def _ledger(ledgers: dict[str, Ledger], domain: str) -> Ledger:
    return ledgers.setdefault(domain, Ledger())


def pack_rows(outs: list[dict], config: PipelineConfig) -> tuple[list[dict], int, int]:
    """Single-output records packed into rows of at most max_packed_len, each row with its
    `doc_lengths`; other data passes through. Returns (rows, tokens dropped, records cut)."""
    pre = config.preprocessing
    if config.multi_output or pre.packing_strategy == "none" or not outs:
        return outs, 0, 0
    keys = [k for k in outs[0] if k != "position_ids"]
    docs = {k: [o[k] for o in outs] for k in keys}
    lengths = [len(o["sequence"]) for o in outs]
    plan, dropped = plan_packing(lengths, pre.max_packed_len, pre.packing_strategy)
    cut = sum(n > pre.max_packed_len for n in lengths) if dropped else 0
    packed = apply_packing(docs, plan)
    mode = config.output.position_ids_mode
    rows = []
    for r, pieces in enumerate(plan):
        row = {k: packed[k][r] for k in keys}
        if mode != "none":
            row["position_ids"] = np.asarray(position_ids(pieces, mode), dtype=np.int32)
        row["doc_lengths"] = np.asarray([e - s for _, s, e in pieces], dtype=np.int32)
        rows.append(row)
    return rows, dropped, cut


def _domain(record: Record, config: PipelineConfig) -> str:
    key = config.output.domain_key
    if key is None:
        return ""
    value = get_field(record, key)
    reserved = isinstance(value, str) and (
        value in _RESERVED
        or value.endswith(_RESERVED_SUFFIXES)
        or TMP_MARK in value
        or is_shard_name(value)
    )
    if not isinstance(value, str) or not _SAFE_DOMAIN.match(value) or reserved:
        raise record_error(
            record,
            key,
            f"domain must be a short name of letters, digits, '.', '_' or '-', and not one the "
            f"dataset uses for its own files ({', '.join(sorted(_RESERVED))}, *.json, *.jsonl, "
            f"*.bin, *.index, shard_N, .tmp-), "
            f"got {value!r}",
            "bad_value",
        )
    return value
