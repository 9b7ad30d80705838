"""Exact-duplicate removal (`preprocessing.dedup: exact`): a record whose normalized text came
before, in this file or any earlier input, is dropped and counted as `duplicate`.

A pre-pass before the run's tasks: each task's records are read and hashed where its work
runs (the engine's `hash_tasks`: local processes or Ray tasks), 8 bytes a record; the driver
finds the duplicates and hands each task the sorted positions of its own (records counted as
the task reads them; an unreadable line is no record), which `task_chunks` sets aside. The
first occurrence in input order (task, then place in the task) is kept: the plan depends on
the files' sizes only, so the same records go on every engine and worker count, and a
resumed run, which does the pre-pass again, drops the very same ones.

The key is `document_text` (the split's: the text fields the sections read, NFC, white space
runs made one space, stripped; case kept) and the tool schemas a chat template renders, of
the record as read, before the map hook (a hook's output is not seen by the pre-pass). A
record missing a field it must have (or holding nothing in it: an empty conversation) has no
text to compare: it is keyed by its place, never a duplicate, so that it is reported as the
bad record it is.

Limits: the driver holds every record's hash (8 B, about three times that while they are
sorted: 1e9 records, 8 GB held); and 64-bit hashes of n distinct texts collide (one false
duplicate) with a chance of about n**2 / 2**65 (1e8 records: 0.03 %; 1e9: 3 %).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.document.cleaning import document_text
from tokenmill.preprocess.inputs.records import Record, RecordError

if TYPE_CHECKING:
    from tokenmill.preprocess.engines.engine import Engine
    from tokenmill.preprocess.engines.tasks import TaskPlan


@dataclass(frozen=True)
class KeyRule:
    """What a config's key reads beyond `document_text`: for each field that compares, in its
    order, whether a record must have it (not when every section reading it is optional,
    nor the shared prompt, made when absent); the tool fields its chat templates render."""

    required: list[bool]
    tools: list[str]

    @classmethod
    def of(cls, config: PipelineConfig) -> KeyRule:
        sections = config.all_sections()
        fields = dict.fromkeys(s.field for s in sections)
        shared = config.input.shared_prompt
        required = [
            f != shared and any(not s.optional for s in sections if s.field == f) for f in fields
        ]
        tools = dict.fromkeys(s.tools_field for s in sections if s.template and s.tools_field)
        return cls(required, [f for f in tools if f is not None])


_NOTHING: tuple[Any, ...] = (None, "", [], {})  # no text there: a bad record, not a copy


def text_hash(record: Record, config: PipelineConfig, rule: KeyRule | None = None) -> int:
    """The record's dedup key as a uint64: its normalized text's (and its tool schemas', which
    a template renders), or (a field it must have is missing or empty) its place's, which no
    other record shares."""
    rule = rule or KeyRule.of(config)
    text = document_text(record, config)
    values = orjson.loads(text)
    if any(need and value in _NOTHING for need, value in zip(rule.required, values, strict=True)):
        key, person = orjson.dumps([record.source, record.line]), b"tokenmill-place"
    else:
        key, person = text.encode(), b"tokenmill-dedup"
        tools = [record.data.get(field) for field in rule.tools]
        if any(t is not None for t in tools):
            key += b"\n" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, person=person).digest(), "little")


def task_hashes(plan: TaskPlan, config_data: dict) -> np.ndarray:
    """A task's records' keys, in the order `task_chunks` reads them (its read errors are
    the task's to report, when it runs): run in a worker, 8 bytes a record come back."""
    from tokenmill.preprocess.engines.tasks import read_piece

    config = PipelineConfig.from_dict(config_data)
    unit, rule = config.input.text_unit, KeyRule.of(config)
    keys = (
        text_hash(record, config, rule)
        for piece in plan.pieces
        for record in read_piece(piece, _ignored, unit)
    )
    return np.fromiter(keys, dtype=np.uint64)


def _ignored(err: RecordError) -> None:
    """A read error in the pre-pass: the task reports it when it runs."""


def duplicate_positions(hashes: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
    """Task number -> the sorted positions (in that task's records) of its duplicates: every
    record whose key an earlier one in task order has. Tasks without any are left out."""
    if not hashes:
        return {}
    keys = np.concatenate(hashes)
    _, first = np.unique(keys, return_index=True)  # each key's first occurrence
    later = np.ones(len(keys), dtype=bool)
    later[first] = False
    positions = np.flatnonzero(later)
    starts = np.cumsum([0, *(len(h) for h in hashes)])
    out = {}
    for task, (start, end) in enumerate(zip(starts[:-1], starts[1:], strict=True)):
        lo, hi = np.searchsorted(positions, [start, end])
        if hi > lo:
            out[task] = positions[lo:hi] - start
    return out


def dedup_plan(
    engine: Engine, plans: Sequence[TaskPlan], config: PipelineConfig
) -> dict[int, np.ndarray]:
    """Task index -> sorted positions of its duplicate records ({} unless `dedup: exact`).
    `plans`: every task of the run, done ones too (a first occurrence may be in one)."""
    if getattr(config.preprocessing, "dedup", "none") != "exact" or not plans:
        return {}
    hashes = list(engine.hash_tasks(plans, config))
    by_number = duplicate_positions(hashes)
    return {plans[number].index: positions for number, positions in by_number.items()}
