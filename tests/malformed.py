"""Malformed-input corpus: files that real pipelines meet, with the outcome tokenmill must give.

Each `Case` is a file (name + bytes) and its expected outcome:
  ("error", reason, "file:line", field)  the first RecordError: its reason slug, the text its
                                         message starts with after the folder, and its exact
                                         `field` (None: no field);
  ("ok", n_records)                      no error, exactly n records.
`level="records"` cases are decided by records.py alone (tests/preprocess/test_records.py): read every
record, then `get_field(record, case.field)` and, when `case.chat`, `check_messages(...,
roles=CHAT_ROLES)`. `level="pipeline"` cases parse cleanly but must fail (or pass) under
`PIPELINE_CONFIGS[case.train_type]` when run through the Pipeline.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

CHAT_ROLES = ("system", "user", "assistant")

# Configs the pipeline-level cases assume (SYSTEM.md spelling; defaults otherwise, min_chars 50).
PIPELINE_CONFIGS: dict[str, dict[str, Any]] = {
    "seq": {"version": 1, "input": {"sections": [{"field": "text", "action": "train"}]}},
    "sft": {
        "version": 1,
        "input": {"sections": [{"field": "messages", "template": True, "action": "$role"}]},
        "mask": {"assistant": "train"},
    },
    "dpo": {
        "version": 1,
        "input": {
            "sources": {
                "chosen": {"sections": [{"field": "chosen", "template": True, "action": "$role"}]},
                "rejected": {
                    "sections": [{"field": "rejected", "template": True, "action": "$role"}]
                },
            }
        },
        "mask": {"assistant": "train"},
    },
    "grpo": {
        "version": 1,
        "input": {
            "sources": {
                "prompts": {"sections": [{"field": "prompt", "template": True, "action": "mask"}]},
                "responses": {
                    "sections": [{"field": "responses", "action": "train"}],
                    "list_field": True,
                    "mask_key": "masks",
                },
                "rewards": {"sections": [{"field": "rewards", "action": "value"}]},
            }
        },
    },
}


@dataclass(frozen=True)
class Case:
    name: str
    filename: str
    content: bytes
    outcome: tuple
    field: str | None = None  # records level: the field read with get_field
    chat: bool = False  # records level: check that field with check_messages
    first: dict | None = None  # "ok" cases: the first record's data, exactly
    level: str = "records"  # "records" | "pipeline"
    train_type: str | None = None  # pipeline level: "seq" | "sft" | "dpo" | "grpo"


def _line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def _lines(*objs: Any) -> bytes:
    return b"".join(_line(o) for o in objs)


def _chat(*turns: tuple[Any, Any]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


GOOD = _chat(("user", "What is 2 + 2?"), ("assistant", "2 + 2 is 4."))
GOOD_LONG = _chat(
    ("user", "Name three primary colours, please."), ("assistant", "Red, yellow and blue.")
)
PROMPT = [{"role": "user", "content": "Write a haiku about rain on a tin roof."}]
CHOSEN = PROMPT + [{"role": "assistant", "content": "Tin roof drums softly / ..."}]
REJECTED = PROMPT + [{"role": "assistant", "content": "Rain is wet."}]


def _gzip_cut(objs: list, keep: int) -> bytes:
    """A gzip stream of `objs` cut right after its first `keep` lines: exactly those survive."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        gz.write(_lines(*objs[:keep]))
        gz.flush()
        cut = buf.tell()
        gz.write(_lines(*objs[keep:]))
    return buf.getvalue()[:cut]


def _zstd_cut(objs: list, keep: int) -> bytes:
    buf = io.BytesIO()
    writer = zstandard.ZstdCompressor().stream_writer(buf, closefd=False)
    writer.write(_lines(*objs[:keep]))
    writer.flush(zstandard.FLUSH_BLOCK)
    cut = buf.tell()
    writer.write(_lines(*objs[keep:]))
    writer.flush(zstandard.FLUSH_FRAME)
    return buf.getvalue()[:cut]


def _parquet(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


TEXTS = [{"text": f"document number {i}"} for i in range(6)]
ERR, OK = "error", "ok"

CASES: list[Case] = [
    # --- JSON syntax -------------------------------------------------------------------
    Case("truncated_last_line", "t.jsonl", _line(GOOD) + b'{"messages": [{"role": "us',
         (ERR, "bad_json", "t.jsonl:2", None)),
    Case("valid_last_line_without_newline", "t.jsonl", _line(GOOD) + _line(GOOD)[:-1], (OK, 2)),
    Case("cr_only_line_endings", "t.jsonl", _line(GOOD)[:-1] + b"\r" + _line(GOOD)[:-1] + b"\r",
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("trailing_comma", "t.jsonl", b'{"text": "a",}\n', (ERR, "bad_json", "t.jsonl:1", None)),
    Case("single_quotes", "t.jsonl", b"{'text': 'a'}\n", (ERR, "bad_json", "t.jsonl:1", None)),
    Case("comment_line", "t.jsonl", b"// exported 2024-01-01\n" + _line(GOOD),
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("python_literals", "t.jsonl", b'{"text": None, "ok": True}\n',
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("two_objects_on_one_line", "t.jsonl", b'{"a": 1} {"b": 2}\n',
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("nan", "t.jsonl", b'{"rewards": [NaN, 1.0]}\n', (ERR, "bad_json", "t.jsonl:1", None)),
    Case("infinity", "t.jsonl", b'{"rewards": [Infinity]}\n', (ERR, "bad_json", "t.jsonl:1", None)),
    Case("negative_infinity", "t.jsonl", _line(GOOD) + b'{"rewards": [-Infinity]}\n',
         (ERR, "bad_json", "t.jsonl:2", None)),
    Case("number_overflows_double", "t.jsonl", b'{"rewards": [1e999]}\n',
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("deeply_nested", "t.jsonl", b'{"a": ' + b"[" * 2000 + b"]" * 2000 + b"}\n",
         (ERR, "bad_json", "t.jsonl:1", None)),
    Case("bad_line_counts_blank_lines", "t.jsonl", _line(GOOD) + b"\n\n{oops\n" + _line(GOOD),
         (ERR, "bad_json", "t.jsonl:4", None)),
    # --- bytes that are not UTF-8 JSON text ---------------------------------------------
    Case("invalid_utf8", "t.jsonl", _line(GOOD) + b'{"text": "caf\xe9"}\n',
         (ERR, "bad_utf8", "t.jsonl:2", None)),
    Case("lone_high_surrogate", "t.jsonl", b'{"text": "a\\ud800b"}\n',
         (ERR, "bad_utf8", "t.jsonl:1", None)),
    Case("lone_low_surrogate", "t.jsonl", b'{"text": "\\udc00"}\n',
         (ERR, "bad_utf8", "t.jsonl:1", None)),
    Case("paired_surrogates", "t.jsonl", b'{"text": "\\ud83d\\ude00"}\n', (OK, 1),
         first={"text": "\U0001f600"}),
    Case("binary_garbage_png", "t.jsonl", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00",
         (ERR, "bad_utf8", "t.jsonl:1", None)),
    Case("nul_bytes", "t.jsonl", b'{"text": "a"}\x00\x00\n', (ERR, "bad_json", "t.jsonl:1", None)),
    Case("utf16_file", "t.jsonl", '{"text": "a"}\n'.encode("utf-16"),
         (ERR, "bad_utf8", "t.jsonl:1", None)),
    Case("bom_on_first_line", "t.jsonl", b"\xef\xbb\xbf" + _lines(GOOD, GOOD), (OK, 2), first=GOOD),
    Case("bom_on_later_line", "t.jsonl", _line(GOOD) + b"\xef\xbb\xbf" + _line(GOOD),
         (ERR, "bad_json", "t.jsonl:2", None)),
    # --- a line that is JSON but not an object -------------------------------------------
    Case("array_line", "t.jsonl", b'[{"text": "a"}]\n', (ERR, "not_object", "t.jsonl:1", None)),
    Case("number_line", "t.jsonl", _line(GOOD) + b"42\n", (ERR, "not_object", "t.jsonl:2", None)),
    Case("string_line", "t.jsonl", b'"hello"\n', (ERR, "not_object", "t.jsonl:1", None)),
    Case("null_line", "t.jsonl", b"null\n", (ERR, "not_object", "t.jsonl:1", None)),
    Case("boolean_line", "t.jsonl", b"true\n", (ERR, "not_object", "t.jsonl:1", None)),
    # --- whitespace and layout -------------------------------------------------------------
    Case("empty_file", "t.jsonl", b"", (OK, 0)),
    Case("blank_lines_only", "t.jsonl", b"\n\n   \n\t\r\n", (OK, 0)),
    Case("blank_lines_between", "t.jsonl", b"\n" + _line(GOOD) + b"  \n\n" + _line(GOOD), (OK, 2)),
    Case("crlf_line_endings", "t.jsonl", _line(GOOD).replace(b"\n", b"\r\n") * 2, (OK, 2), first=GOOD),
    Case("huge_line_10mb", "t.jsonl", _line({"text": "x" * 10_000_000}), (OK, 1)),
    Case("duplicate_keys_last_wins", "t.jsonl", b'{"text": "first", "text": "second"}\n', (OK, 1),
         field="text", first={"text": "second"}),
    Case("extra_unknown_fields", "t.jsonl", _line({**GOOD, "id": 7, "meta": {"lang": "en"}}), (OK, 1),
         field="messages", chat=True),
    # --- fields ------------------------------------------------------------------------------
    Case("missing_field", "t.jsonl", _line({"conversations": [{"from": "human", "value": "hi"}]}),
         (ERR, "missing_field", "t.jsonl:1", "messages"), field="messages", chat=True),
    Case("null_field", "t.jsonl", _line(GOOD) + _line({"messages": None}),
         (ERR, "missing_field", "t.jsonl:2", "messages"), field="messages", chat=True),
    Case("nested_field_missing", "t.jsonl", _line({"meta": {"source": "web"}}),
         (ERR, "missing_field", "t.jsonl:1", "meta.text"), field="meta.text"),
    Case("nested_parent_not_object", "t.jsonl", _line({"meta": "web"}),
         (ERR, "wrong_type", "t.jsonl:1", "meta"), field="meta.text"),
    Case("nested_field_ok", "t.jsonl", _line({"meta": {"text": "hello"}}), (OK, 1), field="meta.text"),
    # --- chats -------------------------------------------------------------------------------
    Case("messages_is_string", "t.jsonl", _line({"messages": "user: hi"}),
         (ERR, "wrong_type", "t.jsonl:1", "messages"), field="messages", chat=True),
    Case("empty_conversation", "t.jsonl", _line({"messages": []}),
         (ERR, "empty", "t.jsonl:1", "messages"), field="messages", chat=True),
    Case("message_not_object", "t.jsonl", _line({"messages": ["hi", "hello"]}),
         (ERR, "wrong_type", "t.jsonl:1", "messages[0]"), field="messages", chat=True),
    Case("content_is_number", "t.jsonl", _line(_chat(("user", "2+2?"), ("assistant", 4))),
         (ERR, "wrong_type", "t.jsonl:1", "messages[1].content"), field="messages", chat=True),
    Case("content_null", "t.jsonl", _line(_chat(("user", "hi"), ("assistant", None))),
         (ERR, "missing_field", "t.jsonl:1", "messages[1].content"), field="messages", chat=True),
    Case("content_empty_string_ok", "t.jsonl", _line(_chat(("system", ""), ("user", "hi"))), (OK, 1),
         field="messages", chat=True),
    Case("role_is_list", "t.jsonl", _line(_chat((["user"], "hi"))),
         (ERR, "wrong_type", "t.jsonl:1", "messages[0].role"), field="messages", chat=True),
    Case("role_missing", "t.jsonl", _line({"messages": [{"content": "hi"}]}),
         (ERR, "missing_field", "t.jsonl:1", "messages[0].role"), field="messages", chat=True),
    Case("unknown_role", "t.jsonl",
         _line(GOOD) + _line(_chat(("user", "weather?"), ("assistant", "calling"), ("tool", "{}"))),
         (ERR, "unknown_role", "t.jsonl:2", "messages[2].role"), field="messages", chat=True),
    Case("sharegpt_roles", "t.jsonl", _line(_chat(("human", "hi"), ("gpt", "hello"))),
         (ERR, "unknown_role", "t.jsonl:1", "messages[0].role"), field="messages", chat=True),
    # --- .json documents -------------------------------------------------------------------------
    Case("json_single_object", "t.json", json.dumps(GOOD).encode(), (OK, 1), first=GOOD),
    Case("json_list", "t.json", json.dumps(TEXTS[:3], indent=2).encode(), (OK, 3)),
    Case("json_empty_list", "t.json", b"[]", (OK, 0)),
    Case("json_whitespace_only", "t.json", b"\n  \n", (OK, 0)),
    Case("json_list_with_non_object", "t.json", json.dumps([TEXTS[0], 3, TEXTS[1]]).encode(),
         (ERR, "not_object", "t.json:2", None)),
    Case("json_scalar_top_level", "t.json", b'"just a string"', (ERR, "not_object", "t.json:1", None)),
    Case("json_syntax_error_names_text_line", "t.json", b'[\n  {"a": 1},\n  {"a": 2,}\n]\n',
         (ERR, "bad_json", "t.json:3", None)),
    Case("json_bom", "t.json", b"\xef\xbb\xbf" + json.dumps([GOOD]).encode(), (OK, 1), first=GOOD),
    # --- compressed and columnar files ---------------------------------------------------------
    Case("valid_gz", "t.jsonl.gz", gzip.compress(_lines(*TEXTS), mtime=0), (OK, 6), first=TEXTS[0]),
    Case("valid_zst", "t.jsonl.zst", zstandard.ZstdCompressor().compress(_lines(*TEXTS)), (OK, 6)),
    Case("truncated_gz", "t.jsonl.gz", _gzip_cut(TEXTS, 3),
         (ERR, "truncated_file", "t.jsonl.gz:4", None)),
    Case("truncated_zst", "t.jsonl.zst", _zstd_cut(TEXTS, 3),
         (ERR, "truncated_file", "t.jsonl.zst:4", None)),
    Case("truncated_json_gz", "t.json.gz", gzip.compress(json.dumps(TEXTS).encode(), mtime=0)[:-12],
         (ERR, "truncated_file", "t.json.gz:1", None)),
    Case("plain_text_named_gz", "t.jsonl.gz", _lines(*TEXTS), (ERR, "corrupt_file", "t.jsonl.gz:1", None)),
    Case("garbage_named_zst", "t.jsonl.zst", b"not zstd at all\n", (ERR, "corrupt_file", "t.jsonl.zst:1", None)),
    Case("valid_parquet", "t.parquet", _parquet([GOOD, GOOD_LONG]), (OK, 2), field="messages", chat=True,
         first=GOOD),
    Case("truncated_parquet", "t.parquet", _parquet([GOOD, GOOD_LONG])[:-20],
         (ERR, "corrupt_file", "t.parquet:1", None)),
    Case("jsonl_named_parquet", "t.parquet", _lines(GOOD), (ERR, "corrupt_file", "t.parquet:1", None)),
    # --- pipeline level: parse fine, fail under the train type's config --------------------------
    Case("dpo_missing_rejected", "dpo.jsonl", _line({"prompt": PROMPT, "chosen": CHOSEN}),
         (ERR, "missing_field", "dpo.jsonl:1", "rejected"), level="pipeline", train_type="dpo"),
    Case("dpo_chosen_not_a_list", "dpo.jsonl",
         _line({"prompt": PROMPT, "chosen": "Tin roof drums softly", "rejected": REJECTED}),
         (ERR, "wrong_type", "dpo.jsonl:1", "chosen"), level="pipeline", train_type="dpo"),
    Case("dpo_rejected_empty", "dpo.jsonl", _line({"prompt": PROMPT, "chosen": CHOSEN, "rejected": []}),
         (ERR, "empty", "dpo.jsonl:1", "rejected"), level="pipeline", train_type="dpo"),
    Case("dpo_identical_pair", "dpo.jsonl", _line({"prompt": PROMPT, "chosen": CHOSEN, "rejected": CHOSEN}),
         (ERR, "identical_pair", "dpo.jsonl:1", "rejected"), level="pipeline", train_type="dpo"),
    Case("grpo_empty_responses", "grpo.jsonl", _line({"prompt": PROMPT, "responses": [], "rewards": []}),
         (ERR, "empty", "grpo.jsonl:1", "responses"), level="pipeline", train_type="grpo"),
    Case("grpo_rewards_length_mismatch", "grpo.jsonl",
         _line({"prompt": PROMPT, "responses": ["Drums on tin.", "Wet."], "rewards": [1.0]}),
         (ERR, "bad_value", "grpo.jsonl:1", "rewards"), level="pipeline", train_type="grpo"),
    Case("grpo_reward_not_a_number", "grpo.jsonl",
         _line({"prompt": PROMPT, "responses": ["Drums on tin.", "Wet."], "rewards": [1.0, "high"]}),
         (ERR, "wrong_type", "grpo.jsonl:1", "rewards[1]"), level="pipeline", train_type="grpo"),
    Case("grpo_reward_nan_in_parquet", "grpo.parquet",
         _parquet([{"prompt": PROMPT, "responses": ["Drums on tin.", "Wet."], "rewards": [1.0, float("nan")]}]),
         (ERR, "bad_value", "grpo.parquet:1", "rewards[1]"), level="pipeline", train_type="grpo"),
    Case("grpo_response_not_a_string", "grpo.jsonl",
         _line({"prompt": PROMPT, "responses": [7, "Wet."], "rewards": [1.0, 0.0]}),
         (ERR, "wrong_type", "grpo.jsonl:1", "responses[0]"), level="pipeline", train_type="grpo"),
    Case("sft_no_trained_tokens", "sft.jsonl",
         _line(GOOD_LONG) + _line(_chat(("system", "Be brief."), ("user", "Just listen to me, please; I only want to talk a while."))),
         (ERR, "no_trained_tokens", "sft.jsonl:2", "messages"), level="pipeline", train_type="sft"),
    Case("seq_too_short", "seq.jsonl", _line({"text": "hi"}),
         (ERR, "too_short", "seq.jsonl:1", None), level="pipeline", train_type="seq"),
    Case("seq_too_long", "seq.jsonl", _line({"text": "word " * 400_001}),
         (ERR, "too_long", "seq.jsonl:1", None), level="pipeline", train_type="seq"),
    Case("seq_text_not_a_string", "seq.jsonl", _line({"text": ["a list", "of strings"]}),
         (ERR, "wrong_type", "seq.jsonl:1", "text"), level="pipeline", train_type="seq"),
]  # fmt: skip

RECORDS_CASES = [c for c in CASES if c.level == "records"]
PIPELINE_CASES = [c for c in CASES if c.level == "pipeline"]
