"""records.py: raw files -> Records with their origin; every bad line named, none dropped."""

from __future__ import annotations

import copy
import gzip
import io
import json
import os
import pickle
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import ROOT
from malformed import CASES, CHAT_ROLES, PIPELINE_CASES, RECORDS_CASES, Case

from tokenmill.preprocess.inputs.fields import check_messages, get_field
from tokenmill.preprocess.inputs.files import INPUT_SUFFIXES, list_inputs
from tokenmill.preprocess.inputs.records import Record, RecordError, read_records

DATA = ROOT / "data"


def _write(tmp_path: Path, name: str, content: bytes) -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def _run_case(path: Path, case: Case) -> list[Record]:
    """What a records-level consumer does: read, then fetch and check the case's field."""
    records = []
    for record in read_records(path):
        if case.field is not None:
            value = get_field(record, case.field)
            if case.chat:
                check_messages(record, case.field, value, CHAT_ROLES)
        records.append(record)
    return records


def _lines(*objs: object) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


# ---- the malformed corpus -----------------------------------------------------------------


def test_corpus_is_large_and_names_are_unique():
    assert len(CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)
    assert all(c.level in ("records", "pipeline") for c in CASES)
    assert all(c.train_type in ("seq", "sft", "dpo", "grpo") for c in PIPELINE_CASES)


@pytest.mark.parametrize("case", RECORDS_CASES, ids=lambda c: c.name)
def test_records_case(tmp_path, case):
    path = _write(tmp_path, case.filename, case.content)
    if case.outcome[0] == "ok":
        records = _run_case(path, case)
        assert len(records) == case.outcome[1]
        if case.first is not None:
            assert records[0].data == case.first
        return
    _, reason, where, field = case.outcome
    with pytest.raises(RecordError) as info:
        _run_case(path, case)
    err = info.value
    assert (err.reason, err.field) == (reason, field), str(err)
    assert str(err).startswith(f"{tmp_path}/{where}: "), str(err)
    assert err.source == str(path)


@pytest.mark.parametrize("case", PIPELINE_CASES, ids=lambda c: c.name)
def test_pipeline_cases_parse_cleanly(tmp_path, case):
    """Pipeline-level cases must get past records.py: their failure belongs to a later stage."""
    path = _write(tmp_path, case.filename, case.content)
    records = list(read_records(path))
    assert len(records) == int(case.outcome[2].rsplit(":", 1)[1])  # the bad record is the last


@pytest.mark.parametrize(
    "case",
    [c for c in RECORDS_CASES if c.filename.endswith((".jsonl", ".json"))],
    ids=lambda c: c.name,
)
def test_collector_accounts_for_every_line(tmp_path, case):
    """With a collector nothing is dropped: records + errors == non-blank lines (or list items)."""
    path = _write(tmp_path, case.filename, case.content)
    errors: list[RecordError] = []
    records = list(read_records(path, on_error=errors.append))
    if case.filename.endswith(".jsonl"):
        lines = case.content.removeprefix(b"\xef\xbb\xbf").split(b"\n")  # JSONL breaks at \n only
        expected = sum(1 for line in lines if line.strip(b" \t\r\n"))
        assert len(records) + len(errors) == expected
    lines_seen = [r.line for r in records] + [e.line for e in errors]
    assert len(set(lines_seen)) == len(lines_seen)


# ---- errors --------------------------------------------------------------------------------


def test_error_text_and_pickle_round_trip():
    err = RecordError(
        "data/sft.jsonl",
        1042,
        "messages[3].role",
        'expected one of [a], got "tool"',
        "unknown_role",
    )
    assert str(err) == 'data/sft.jsonl:1042: messages[3].role: expected one of [a], got "tool"'
    no_field = RecordError("a.jsonl", 3, None, "expected a JSON object, got array", "not_object")
    assert str(no_field) == "a.jsonl:3: expected a JSON object, got array"
    back = copy.deepcopy(err)  # the same reduce protocol pickle uses between processes
    assert (back.source, back.line, back.field, back.message, back.reason) == (
        "data/sft.jsonl",
        1042,
        "messages[3].role",
        'expected one of [a], got "tool"',
        "unknown_role",
    )
    assert str(back) == str(err) and isinstance(back, ValueError)
    record = Record("a.jsonl", 2, {"text": "hi"})
    assert copy.deepcopy(record) == record and pickle.dumps(record)


def test_unknown_reason_is_a_programming_error():
    with pytest.raises(ValueError, match="unknown RecordError reason 'typo'"):
        RecordError("a.jsonl", 1, None, "x", "typo")


def test_messages_say_what_is_wrong(tmp_path):
    def first_error(content: bytes, name: str = "a.jsonl") -> str:
        with pytest.raises(RecordError) as info:
            list(read_records(_write(tmp_path, name, content)))
        return str(info.value).removeprefix(f"{tmp_path}/")

    assert first_error(b'{"r": NaN}\n') == (
        "a.jsonl:1: invalid JSON at column 7: NaN is not valid JSON (write null or a finite number)"
    )
    assert first_error(b'{"r": -Infinity}\n').endswith(
        "Infinity is not valid JSON (write null or a finite number)"
    )
    assert first_error(b'{"t": "caf\xe9"}\n') == (
        "a.jsonl:1: not UTF-8 text: byte 0xe9 at byte 11 of the line"
    )
    assert "cannot be encoded as UTF-8" in first_error(b'{"t": "\\ud800"}\n')
    assert first_error(b'{"a": 1}\n{"a": ').startswith(
        "a.jsonl:2: truncated last line (no newline at end of file): invalid JSON at column 7:"
    )
    assert first_error(b"[1]\n") == "a.jsonl:1: expected a JSON object, got array"
    assert (
        first_error(b'[{"a": 1}, null]', "b.json")
        == "b.json:2: list element: expected a JSON object, got null"
    )


def test_field_errors_name_the_place():
    record = Record(
        "d/sft.jsonl",
        7,
        {
            "id": 1,
            "messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}],
        },
    )
    with pytest.raises(RecordError) as info:
        check_messages(record, "messages", record.data["messages"], ["user", "system", "assistant"])
    assert (
        str(info.value)
        == 'd/sft.jsonl:7: messages[1].role: expected one of [assistant, system, user], got "tool"'
    )
    with pytest.raises(RecordError) as info:
        get_field(record, "conversations")
    assert (
        str(info.value)
        == "d/sft.jsonl:7: conversations: missing field (record has: id, messages); "
        "map one with input.columns: {conversations: <its key>}"
    )
    assert info.value.reason == "missing_field"
    with pytest.raises(RecordError) as info:
        check_messages(record, "messages", [{"role": "user", "content": 4}], None)
    assert str(info.value) == "d/sft.jsonl:7: messages[0].content: expected a string, got number 4"


def test_get_field_and_check_messages_values():
    record = Record(
        "x.jsonl",
        1,
        {
            "meta": {"lang": "en", "none": None},
            "chat": [{"role": "tool", "content": "", "name": "calc"}],
        },
    )
    assert get_field(record, "meta.lang") == "en"
    assert get_field(record, "meta") == {"lang": "en", "none": None}
    with pytest.raises(RecordError, match=r"x.jsonl:1: meta.none: is null") as info:
        get_field(record, "meta.none")
    assert info.value.reason == "missing_field"
    chat = check_messages(record, "chat", record.data["chat"], None)
    assert chat == [{"role": "tool", "content": "", "name": "calc"}]


# ---- collector mode --------------------------------------------------------------------------


def test_collector_keeps_good_records_and_reports_each_bad_line_once(tmp_path):
    content = (
        _lines({"text": "one"})
        + b"{bad\n"
        + b"\n"
        + _lines({"text": "four"})
        + b"42\n"
        + b'{"t": "\xff"}\n'
        + _lines({"text": "seven"})
        + b'{"r": NaN}\n'
        + b'{"text": "nine"'
    )
    path = _write(tmp_path, "mixed.jsonl", content)
    errors: list[RecordError] = []
    records = list(read_records(path, on_error=errors.append))
    assert [(r.line, r.data["text"]) for r in records] == [(1, "one"), (4, "four"), (7, "seven")]
    assert [(e.line, e.reason) for e in errors] == [
        (2, "bad_json"),
        (5, "not_object"),
        (6, "bad_utf8"),
        (8, "bad_json"),
        (9, "bad_json"),
    ]
    assert len(records) + len(errors) == 8  # 9 lines, one blank
    with pytest.raises(RecordError, match="mixed.jsonl:2: invalid JSON"):
        list(read_records(path))


def test_json_list_collector_and_positions(tmp_path):
    items = [{"text": "a"}, 1, {"text": "c"}, "d", {"text": "e"}]
    path = _write(tmp_path, "list.json", json.dumps(items, indent=2).encode())
    errors: list[RecordError] = []
    records = list(read_records(path, on_error=errors.append))
    assert [(r.line, r.data["text"]) for r in records] == [(1, "a"), (3, "c"), (5, "e")]
    assert [(e.line, e.reason) for e in errors] == [(2, "not_object"), (4, "not_object")]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst"])
def test_truncated_stream_reports_once_and_stops(tmp_path, suffix):
    case = next(c for c in CASES if c.filename.endswith(suffix) and c.name.startswith("truncated"))
    path = _write(tmp_path, "cut" + suffix, case.content)
    errors: list[RecordError] = []
    records = list(read_records(path, on_error=errors.append))
    assert [r.data["text"] for r in records] == [f"document number {i}" for i in range(3)]
    assert [(e.line, e.reason) for e in errors] == [(4, "truncated_file")]
    assert "file ends early, after line 3" in errors[0].message


# ---- formats -----------------------------------------------------------------------------------


def _compress(suffix: str, raw: bytes) -> bytes:
    if suffix.endswith(".gz"):
        return gzip.compress(raw, mtime=0)
    if suffix.endswith(".zst"):
        return zstandard.ZstdCompressor().compress(raw)
    return raw


@pytest.mark.parametrize("suffix", [s for s in INPUT_SUFFIXES if ".json" in s])
def test_round_trip_every_json_form(tmp_path, suffix):
    objs = [{"id": i, "text": f"line {i} é😀"} for i in range(2500)]
    raw = _lines(*objs) if ".jsonl" in suffix else json.dumps(objs).encode()
    path = _write(tmp_path, "data" + suffix, _compress(suffix, raw))
    records = list(read_records(path))
    assert [r.data for r in records] == objs
    assert [r.line for r in records] == list(range(1, 2501))
    assert {r.source for r in records} == {str(path)}


@pytest.mark.parametrize("suffix", [s for s in INPUT_SUFFIXES if s.startswith(".txt")])
def test_text_files_whole_or_by_line(tmp_path, suffix):
    text = "".join(f"line {i} é😀\r\n" if i % 3 else f"line {i}\n" for i in range(2500))
    path = _write(tmp_path, "data" + suffix, _compress(suffix, text.encode()))
    assert [(r.line, r.data) for r in read_records(path)] == [(1, {"text": text})]
    lines = list(read_records(path, text_unit="line"))
    assert [r.data["text"] for r in lines] == [x.removesuffix("\r") for x in text.split("\n")[:-1]]
    assert [r.line for r in lines] == list(range(1, 2501))


def test_multi_member_gzip_and_multi_frame_zstd(tmp_path):
    a, b = _lines({"i": 1}, {"i": 2}), _lines({"i": 3})
    gz = _write(tmp_path, "m.jsonl.gz", gzip.compress(a) + gzip.compress(b))
    zst = _write(tmp_path, "m.jsonl.zst", zstandard.ZstdCompressor().compress(a) * 2 + b"")
    assert [r.data["i"] for r in read_records(gz)] == [1, 2, 3]
    assert [r.data["i"] for r in read_records(zst)] == [1, 2, 1, 2]
    empty = _write(tmp_path, "e.jsonl.zst", b"")
    assert list(read_records(empty)) == []


def test_zstd_without_content_size_streams(tmp_path):
    buf = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as writer:
        for i in range(20_000):
            writer.write(_lines({"i": i}))
    path = _write(tmp_path, "s.jsonl.zst", buf.getvalue())
    assert [r.data["i"] for r in read_records(path)] == list(range(20_000))


def test_parquet_rows_in_batches_with_positions(tmp_path):
    rows = [
        {
            "id": i,
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": f"a{i}"},
            ],
            "meta": {"lang": "en" if i % 2 else None},
        }
        for i in range(2500)
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    assert pq.ParquetFile(path).num_row_groups == 4
    records = list(read_records(path))
    assert [r.line for r in records] == list(range(1, 2501))
    assert [r.data for r in records] == rows
    assert check_messages(records[5], "messages", get_field(records[5], "messages"), CHAT_ROLES)[
        1
    ] == {
        "role": "assistant",
        "content": "a5",
    }
    with pytest.raises(RecordError, match=r"chat.parquet:1: meta.lang: is null"):
        get_field(records[0], "meta.lang")


def test_real_chat_data_passes_and_raw_sharegpt_is_reported():
    records = list(read_records(DATA / "chat_sharegpt_1000.jsonl"))
    assert len(records) == 1000
    for record in records:
        check_messages(record, "messages", get_field(record, "messages"), CHAT_ROLES)
    raw = list(read_records(DATA / "chat_sharegpt_raw_200.jsonl"))
    assert len(raw) == 200
    with pytest.raises(RecordError) as info:
        get_field(raw[0], "messages")
    assert str(info.value).endswith(
        "chat_sharegpt_raw_200.jsonl:1: messages: missing field (record has: id, conversations); "
        "map one with input.columns: {messages: <its key>}"
    )


def test_reading_streams_instead_of_loading_the_file(tmp_path):
    line = json.dumps({"text": "x" * 200}).encode() + b"\n"
    path = _write(tmp_path, "big.jsonl", line * 40_000)  # 8.4 MB
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_records(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 40_000
    assert peak < 2_000_000


# ---- list_inputs ------------------------------------------------------------------------------


def test_list_inputs_expands_folders_recursively_and_sorted(tmp_path):
    for name in [
        "b.jsonl",
        "a/z.json",
        "a/b/c.parquet",
        "a.jsonl.gz",
        "a-b/x.jsonl.zst",
        "_SUCCESS",
        ".hidden/x.jsonl",
        "a/.DS_Store",
        "a/_meta/y.jsonl",
    ]:
        _write(tmp_path / "in", name, b"")
    single = _write(tmp_path, "one.json", b"{}")
    found = list_inputs([single, str(tmp_path / "in")])
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "one.json",
        "in/a/b/c.parquet",
        "in/a/z.json",
        "in/a-b/x.jsonl.zst",
        "in/a.jsonl.gz",
        "in/b.jsonl",
    ]


def test_list_inputs_errors(tmp_path):
    bad = _write(tmp_path, "notes.csv", b"a,b\n")
    with pytest.raises(ValueError) as info:
        list_inputs([bad])
    assert str(info.value) == (
        f"{bad}: unsupported input file (supported suffixes: .jsonl, .json, .jsonl.gz, .json.gz, "
        ".jsonl.zst, .json.zst, .parquet, .arrow, .txt, .txt.gz, .txt.zst)"
    )
    _write(tmp_path, "mixed/readme.md", b"")
    with pytest.raises(ValueError, match=r"readme.md: unsupported input file"):
        list_inputs([tmp_path / "mixed"])
    with pytest.raises(FileNotFoundError, match="input not found: .*missing.jsonl"):
        list_inputs([tmp_path / "missing.jsonl"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no input files"):
        list_inputs([tmp_path / "empty"])
    with pytest.raises(ValueError, match="no input files given"):
        list_inputs([])
    good = _write(tmp_path, "dup/a.jsonl", b"")
    with pytest.raises(ValueError, match="listed twice"):
        list_inputs([good, tmp_path / "dup"])
    with pytest.raises(ValueError, match="unsupported input file"):
        list(read_records(bad))


# ---- URLs (fsspec) ----------------------------------------------------------------------------


def _every_format(folder: Path) -> None:
    chat = (DATA / "chat_sharegpt_1000.jsonl").read_bytes().splitlines(keepends=True)
    _write(folder, "a.jsonl", b"".join(chat[:3]) + b"{bad\n")
    _write(folder, "b/c.jsonl.gz", gzip.compress(b"".join(chat[3:6]), mtime=0))
    _write(folder, "b/d.jsonl.zst", zstandard.ZstdCompressor().compress(b"".join(chat[6:9])))
    _write(folder, "e.json", json.dumps([json.loads(x) for x in chat[9:11]]).encode())
    table = pa.Table.from_pylist([json.loads(x) for x in chat[11:15]])
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=3)
    _write(folder, "f.parquet", sink.getvalue())
    _write(folder, "_SUCCESS", b"")
    _write(folder, "g.jsonl.gz", gzip.compress(b"".join(chat[15:18]), mtime=0)[:-30])  # truncated


def _read_all(path) -> tuple[list, list]:
    errors: list[RecordError] = []
    records = [(r.source, r.line, r.data) for r in read_records(path, on_error=errors.append)]
    return records, [(e.source, e.line, e.reason) for e in errors]


def test_urls_are_listed_and_read_like_local_paths(tmp_path):
    import fsspec

    folder = tmp_path / "in"
    _every_format(folder)
    memory = fsspec.filesystem("memory")
    for path in folder.rglob("*"):
        if path.is_file():
            memory.pipe(f"/urls/{path.relative_to(folder).as_posix()}", path.read_bytes())
    local = list_inputs([folder])
    names = [p.relative_to(folder).as_posix() for p in local]
    assert names == [
        "a.jsonl",
        "b/c.jsonl.gz",
        "b/d.jsonl.zst",
        "e.json",
        "f.parquet",
        "g.jsonl.gz",
    ]
    for root in (folder.as_uri(), "memory://urls"):  # fsspec: its local and in-memory filesystems
        urls = list_inputs([root])
        assert urls == [f"{root}/{name}" for name in names]
        for path, url in zip(local, urls):
            records, errors = _read_all(path)
            url_records, url_errors = _read_all(url)
            assert [(line, data) for _, line, data in url_records] == [
                (line, data) for _, line, data in records
            ]
            assert {source for source, _, _ in url_records} <= {url}
            assert url_errors == [(url, line, reason) for _, line, reason in errors]
    assert _read_all(local[0])[1] == [(str(local[0]), 4, "bad_json")]
    assert _read_all(local[-1])[1] == [(str(local[-1]), 3, "truncated_file")]
    assert list_inputs([f"{folder.as_uri()}/e.json"]) == [f"{folder.as_uri()}/e.json"]
    with pytest.raises(FileNotFoundError, match="input not found: memory://urls/nope"):
        list_inputs(["memory://urls/nope"])
    with pytest.raises(ValueError, match="listed twice"):
        list_inputs(["memory://urls", "memory://urls/e.json"])


def test_cr_only_line_endings_are_named_not_called_a_truncated_line(tmp_path):
    path = tmp_path / "mac.jsonl"
    path.write_bytes(b'{"text": "one"}\r{"text": "two"}\r')
    with pytest.raises(RecordError, match=r"mac\.jsonl:1: .*CR-only \(classic Mac\) line endings"):
        list(read_records(path))


def test_symlinked_folders_are_read_once_and_a_link_back_up_does_not_loop(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a.jsonl").write_text('{"text": "a"}\n')
    top = tmp_path / "top"
    top.mkdir()
    (top / "b.jsonl").write_text('{"text": "b"}\n')
    (top / "linked").symlink_to(real)
    (real / "loop").symlink_to(top)  # top/linked/loop -> top
    assert [p.relative_to(top).as_posix() for p in list_inputs([top])] == [
        "b.jsonl",
        "linked/a.jsonl",
    ]


def test_a_name_that_is_not_utf8_is_refused_by_name(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    bad = os.fsdecode(bytes(folder) + b"/caf\xe9.jsonl")
    Path(bad).write_text('{"text": "a"}\n')
    with pytest.raises(ValueError, match="caf.*is not valid UTF-8; rename it"):
        list_inputs([folder])
    with pytest.raises(ValueError, match="is not valid UTF-8"):
        list_inputs([bad])
