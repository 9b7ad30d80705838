"""The on-disk format: exact bytes written, atomic publishing, and what verify catches."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xxhash
from helpers import ROOT

from tokenmill.shards.format import (
    FORMAT_VERSION,
    NO_POSITION,
    Column,
    DocumentLengths,
    opens_document,
)
from tokenmill.shards.manifest import read_manifest, write_manifest
from tokenmill.shards.reader import find_shards, read_meta
from tokenmill.shards.verify import verify_dataset
from tokenmill.shards.writer import ShardSpec, ShardWriter, write_shard

SFT = {"sequence": "int32", "loss_mask": "bool", "position_ids": "int32"}
GRPO = {"prompts": "int32", "responses": "int32", "masks": "bool", "rewards": "float32"}


def sft_record(ids):
    ids = np.asarray(ids, np.int64)
    return {"sequence": ids, "loss_mask": ids % 2 == 1, "position_ids": np.arange(len(ids))}


def grpo_record(prompt, responses, rewards):
    return {
        "prompts": np.asarray(prompt),
        "responses": [np.asarray(r) for r in responses],
        "masks": [np.asarray(r) > 2 for r in responses],
        "rewards": np.asarray(rewards, np.float32),
    }


def write_dataset(root: Path, records, dtypes=SFT, primary="sequence", max_tokens=100, **kw):
    with ShardWriter(root, dtypes, primary, max_tokens, **kw) as writer:
        for record in records:
            writer.add(record)
    write_manifest(root, {"primary_key": primary, "domains": {"": writer.published}})
    return writer.published


def tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_stream_keys_written_exactly(tmp_path):
    infos = write_dataset(
        tmp_path, [sft_record([5, 6, 7]), sft_record([8, 9]), sft_record([1, 2, 3, 4])]
    )
    meta_xxh64 = infos[0].pop("meta_xxh64")  # the manifest covers meta.json too
    assert infos == [{"name": "shard_00000", "records": 3, "tokens": 9, "keys": list(SFT)}]
    assert (
        meta_xxh64
        == xxhash.xxh64((tmp_path / "shard_00000" / "meta.json").read_bytes()).hexdigest()
    )
    shard = tmp_path / "shard_00000"
    assert sorted(p.name for p in shard.iterdir()) == [
        "loss_mask.bin",
        "loss_mask.offsets.bin",
        "meta.json",
        "position_ids.bin",
        "position_ids.offsets.bin",
        "sequence.bin",
        "sequence.offsets.bin",
    ]
    seq = (shard / "sequence.bin").read_bytes()
    assert seq == np.array([5, 6, 7, 8, 9, 1, 2, 3, 4], "<i4").tobytes()
    assert (shard / "loss_mask.bin").read_bytes() == bytes([1, 0, 1, 0, 1, 1, 0, 1, 0])
    assert np.fromfile(shard / "position_ids.bin", "<i4").tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    offsets = (shard / "sequence.offsets.bin").read_bytes()
    assert offsets == np.array([0, 3, 5, 9], "<i8").tobytes()
    meta = json.loads((shard / "meta.json").read_text())
    seq_hash, offsets_hash = xxhash.xxh64(seq).hexdigest(), xxhash.xxh64(offsets).hexdigest()
    assert meta["sequence"] == {
        "shape": [9],
        "dtype": "int32",
        "nbytes": 36,
        "xxh64": seq_hash,
        "pages": {"bytes": 1 << 20, "xxh64": seq_hash},  # one page: the whole file's digest
        "offsets": {
            "file": "sequence.offsets.bin",
            "count": 4,
            "xxh64": offsets_hash,
            "pages": {"bytes": 1 << 20, "xxh64": offsets_hash},
        },
    }
    assert list(meta) == list(SFT) and meta["loss_mask"]["nbytes"] == 9
    assert read_meta(shard) == meta and verify_dataset(tmp_path) == []


def test_record_and_list_keys_written_exactly(tmp_path):
    records = [
        grpo_record([1, 2], [[3, 4, 5], [6]], [1.0, 0.25]),
        grpo_record([7], [[8, 9], [], [1, 2, 3, 4]], [0.0, 0.1, -2.0]),
    ]
    infos = write_dataset(tmp_path, records, GRPO, primary="prompts")
    assert infos[0]["records"] == 2 and infos[0]["tokens"] == 3
    shard = tmp_path / "shard_00000"
    assert np.fromfile(shard / "responses.bin", "<i4").tolist() == [3, 4, 5, 6, 8, 9, 1, 2, 3, 4]
    assert np.fromfile(shard / "responses.items.bin", "<i8").tolist() == [0, 3, 4, 6, 6, 10]
    assert np.fromfile(shard / "responses.offsets.bin", "<i8").tolist() == [0, 2, 5]
    assert np.fromfile(shard / "masks.bin", np.uint8).tolist() == [1, 1, 1, 1, 1, 1, 0, 0, 1, 1]
    assert np.fromfile(shard / "rewards.bin", "<f4").tolist() == [
        1.0,
        0.25,
        0.0,
        np.float32(0.1),
        -2.0,
    ]
    assert np.fromfile(shard / "rewards.offsets.bin", "<i8").tolist() == [0, 2, 5]
    meta = read_meta(shard)
    assert meta["responses"]["items"]["count"] == 6 and meta["responses"]["offsets"]["count"] == 3
    assert "items" not in meta["rewards"] and verify_dataset(tmp_path) == []


def test_shards_roll_before_the_limit_is_passed(tmp_path):
    lengths = [4, 4, 4, 11, 1]
    infos = write_dataset(
        tmp_path, [sft_record(range(n)) for n in lengths], max_tokens=10, first_index=7
    )
    assert [(i["name"], i["records"], i["tokens"]) for i in infos] == [
        ("shard_00007", 2, 8),
        ("shard_00008", 1, 4),
        ("shard_00009", 1, 11),
        ("shard_00010", 1, 1),
    ]
    assert [p.name for p in find_shards(tmp_path)] == [i["name"] for i in infos]
    assert verify_dataset(tmp_path) == []


def test_same_input_gives_same_bytes(tmp_path):
    records = [grpo_record([i, i + 1], [[i] * (i % 3 + 1), [2, i]], [0.5, i]) for i in range(20)]
    write_dataset(tmp_path / "a", records, GRPO, primary="prompts", max_tokens=9)
    write_dataset(tmp_path / "b", records, GRPO, primary="prompts", max_tokens=9)
    a, b = tree(tmp_path / "a"), tree(tmp_path / "b")
    assert len(a) == 1 + 5 * 11 and a == b  # manifest + 5 shards of 11 files


def test_jsonl_storage_format(tmp_path):
    records = [
        grpo_record([1, 2], [[3], [4, 5]], [0.1, 1.0]),
        grpo_record([6, 7, 8], [[9]], [-0.5]),
    ]
    infos = write_dataset(
        tmp_path, records, GRPO, primary="prompts", max_tokens=3, storage_format="jsonl"
    )
    assert [(i["name"], i["records"], i["tokens"]) for i in infos] == [
        ("part_00000.jsonl", 1, 2),
        ("part_00001.jsonl", 1, 3),
    ]
    assert (tmp_path / "part_00000.jsonl").read_text() == (
        '{"prompts":[1,2],"responses":[[3],[4,5]],"masks":[[1],[1,1]],"rewards":[0.1,1.0]}\n'
    )
    assert json.loads((tmp_path / "part_00001.jsonl").read_text())["rewards"] == [-0.5]
    assert (
        infos[0]["xxh64"] == xxhash.xxh64((tmp_path / "part_00000.jsonl").read_bytes()).hexdigest()
    )
    assert verify_dataset(tmp_path) == []
    with open(tmp_path / "part_00001.jsonl", "ab") as f:
        f.write(b"\n")
    (tmp_path / "part_00002.jsonl").write_bytes((tmp_path / "part_00000.jsonl").read_bytes())
    assert verify_dataset(tmp_path) == [
        f"part_00001.jsonl: {infos[1]['nbytes'] + 1} bytes, manifest.json says {infos[1]['nbytes']}: truncated",
        "part_00002.jsonl: part not listed in manifest.json",
    ]


@pytest.mark.parametrize(
    "records, message",
    [
        (
            [sft_record([1]), {"sequence": np.array([1]), "loss_mask": np.array([True])}],
            "missing ['position_ids']",
        ),
        ([{"sequence": np.array([2**40])}], "do not fit int32"),
        ([{"sequence": np.array([1]), "loss_mask": np.array([2])}], "do not fit bool"),
        ([{"loss_mask": np.array([True])}], "primary key 'sequence' is not in the record keys"),
        ([{"sequence": np.array([[1, 2]])}], "expected a flat array"),
        ([{"sequence": np.array([1]), "x/y": np.array([1])}], "cannot name a file"),
        (
            [{"sequence": np.array([1]), "r": np.array([1.5])}],
            "key 'r': dtype 'float64x' is not one of",
        ),
    ],
)
def test_writer_rejects_bad_records(tmp_path, records, message):
    writer = ShardWriter(tmp_path, {**SFT, "r": "float64x"}, "sequence", 100)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        for record in records:
            writer.add(record)
        writer.close()
    writer.abort()
    assert not any(tmp_path.iterdir())


def test_list_key_must_stay_a_list(tmp_path):
    writer = ShardWriter(tmp_path, GRPO, "prompts", 100)
    writer.add(grpo_record([1], [[2]], [1.0]))
    writer.add({**grpo_record([1], [[2]], [1.0]), "responses": []})  # an empty group is a list
    with pytest.raises(ValueError, match="key 'responses': expected a list of arrays"):
        writer.add({**grpo_record([1], [[2]], [1.0]), "responses": np.array([2])})


def test_exception_mid_shard_publishes_nothing(tmp_path):
    columns = {
        "sequence": Column(np.arange(5), np.array([0, 5])),
        "loss_mask": Column(np.array([0, 1, 7, 1, 0]), np.array([0, 5])),  # 7 is no bool
    }
    with pytest.raises(ValueError, match="key 'loss_mask': values in \\[0, 7\\] do not fit bool"):
        write_shard(tmp_path / "shard_00000", columns, SFT)
    assert list(tmp_path.iterdir()) == []
    write_shard(tmp_path / "shard_00000", {"sequence": columns["sequence"]}, SFT)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        write_shard(tmp_path / "shard_00000", {"sequence": columns["sequence"]}, SFT)


@pytest.mark.slow
def test_process_killed_mid_write_leaves_only_a_temp_folder(tmp_path):
    """The kernel kills the writer (SIGXFSZ at a 64 KiB file-size limit) inside a .bin write."""
    child = textwrap.dedent(f"""
        import resource, signal, numpy as np
        from tokenmill.shards.writer import ShardWriter
        writer = ShardWriter({str(tmp_path)!r}, {{"sequence": "int32"}}, "sequence", 10**9)
        writer.add({{"sequence": np.arange(10_000)}})
        writer.close()  # the first shard is 40 KB: published
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
        writer = ShardWriter({str(tmp_path)!r}, {{"sequence": "int32"}}, "sequence", 10**9, first_index=1)
        writer.add({{"sequence": np.arange(100_000)}})
        writer.close()
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGXFSZ, proc.stderr.decode()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "shard_00000" and len(names) == 2
    assert names[1].startswith("shard_00001.tmp-")  # no shard_00001: it never became visible
    assert not (tmp_path / names[1] / "meta.json").exists()
    assert [p.name for p in find_shards(tmp_path)] == ["shard_00000"]
    assert verify_dataset(tmp_path, require_manifest=False) == [
        f"{names[1]}: leftover temp folder from an interrupted write; remove it (or rerun the job)"
    ]


def corrupt(path: Path, position: int, value: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(position)
        f.write(value)


def test_verify_finds_flipped_byte_truncation_and_bad_offsets(tmp_path):
    write_dataset(tmp_path, [sft_record(range(n)) for n in (3, 4, 5, 6)], max_tokens=8)
    shard0, shard1 = tmp_path / "shard_00000", tmp_path / "shard_00001"
    corrupt(shard0 / "sequence.bin", 5, b"\x01")
    with open(shard1 / "position_ids.bin", "r+b") as f:
        f.truncate(8)
    offsets = np.array([0, 7], "<i8")  # shard_00001 holds one record of 5 tokens
    offsets.tofile(shard1 / "loss_mask.offsets.bin")
    meta = read_meta(shard1)
    meta["loss_mask"]["offsets"]["xxh64"] = xxhash.xxh64(offsets.tobytes()).hexdigest()
    (shard1 / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "shard_00002.tmp-123").mkdir()
    assert verify_dataset(tmp_path) == [
        "shard_00002.tmp-123: leftover temp folder from an interrupted write; remove it (or rerun the job)",
        "shard_00000/sequence.bin: key 'sequence': xxh64 checksum mismatch: the data is corrupted",
        "shard_00001/loss_mask.offsets.bin: key 'loss_mask': offsets[1] = 7 out of range [0, 5]",
        "shard_00001/position_ids.bin: key 'position_ids': 8 bytes, expected 20 "
        "(shape [5] of int32): truncated or overwritten",
        "shard_00001/meta.json: edited since it was written (xxh64 differs from manifest.json)",
    ]


def test_verify_finds_unordered_offsets_and_manifest_disagreement(tmp_path):
    write_dataset(tmp_path, [sft_record(range(n)) for n in (3, 4, 5, 6)], max_tokens=8)
    meta = read_meta(tmp_path / "shard_00000")
    meta["sequence"]["offsets"] = [0, 5, 3]  # seed-style inline list, out of order
    del meta["loss_mask"]["xxh64"]
    (tmp_path / "shard_00000" / "meta.json").write_text(json.dumps(meta))
    os.rename(tmp_path / "shard_00002", tmp_path / "extra")
    manifest = read_manifest(tmp_path)
    manifest["domains"][""][1]["tokens"] = 99
    write_manifest(tmp_path, manifest)
    assert verify_dataset(tmp_path) == [
        "shard_00000/meta.json: key 'sequence' (inline): offsets not monotonic: [1] = 5 > [2] = 3",
        "shard_00000/meta.json: edited since it was written (xxh64 differs from manifest.json)",
        "shard_00001: manifest.json says 99 tokens, meta.json has 5",
        "shard_00002: listed in manifest.json but missing",
        "extra: shard not listed in manifest.json",
    ]
    (tmp_path / "manifest.json").unlink()
    assert (
        verify_dataset(tmp_path)[-1]
        == "manifest.json: missing, so the run that wrote this dataset did not finish"
    )


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"sequence": {"shape": [3, 1], "dtype": "int32"}}, "shape must be \\[n\\]"),
        ({"sequence": {"shape": [3], "dtype": "int31"}}, "dtype 'int31' is not one of"),
        ({"sequence": {"shape": [3], "dtype": "int32", "nbytes": 13}}, "nbytes 13 does not match"),
        (
            {"sequence": {"shape": [3], "dtype": "int32", "offsets": {"file": "../x", "count": 2}}},
            "offsets must be",
        ),
        (
            {
                "a": {"shape": [3], "dtype": "int32", "offsets": [0, 3]},
                "b": {"shape": [3], "dtype": "int32", "offsets": [0, 1, 3]},
            },
            "keys disagree on the number of records: {'a': 1, 'b': 2}",
        ),
        ([1, 2], "expected a mapping"),
    ],
)
def test_read_meta_names_file_and_key(tmp_path, meta, message):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message) as err:
        read_meta(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'meta.json'}: ")


def test_manifest_round_trip_and_version_check(tmp_path):
    assert read_manifest(tmp_path) is None
    write_manifest(tmp_path, {"domains": {"web": []}, "fingerprint": "abc"})
    assert read_manifest(tmp_path) == {
        "format_version": FORMAT_VERSION,
        "domains": {"web": []},
        "fingerprint": "abc",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]
    with pytest.raises(ValueError, match="'domains' must map"):
        write_manifest(tmp_path, {"domains": ["shard_00000"]})
    write_manifest(tmp_path, {"format_version": FORMAT_VERSION + 1, "domains": {}})
    with pytest.raises(ValueError, match="is newer than this tokenmill reads"):
        read_manifest(tmp_path)


def test_find_shards_orders_domains_then_shard_numbers(tmp_path):
    for rel in ("web/shard_100000", "web/shard_99999", "code/shard_00002", "web/shard_00001.tmp-9"):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "meta.json").write_text("{}")
    found = [p.relative_to(tmp_path).as_posix() for p in find_shards(tmp_path)]
    assert found == ["code/shard_00002", "web/shard_99999", "web/shard_100000"]


def test_verify_checks_that_stored_document_boundaries_add_up_to_their_rows(tmp_path):
    """A row's doc_lengths are what training trusts for cu_seqlens: verify re-adds them."""
    rows = [
        {"sequence": np.arange(5), "doc_lengths": np.array([2, 3], np.int32)},
        {"sequence": np.arange(4), "doc_lengths": np.array([4], np.int32)},
    ]
    with ShardWriter(
        tmp_path, {"sequence": "int32", "doc_lengths": "int32"}, "sequence", 10**6
    ) as w:
        for row in rows:
            w.add(row)
    assert verify_dataset(tmp_path, require_manifest=False) == []
    shard = find_shards(tmp_path)[0]
    bad = np.array([2, 2, 4], np.int32)  # row 0 now adds up to 4, not 5
    bad.tofile(shard / "doc_lengths.bin")
    meta = read_meta(shard)
    meta["doc_lengths"]["xxh64"] = xxhash.xxh64(bad.tobytes()).hexdigest()
    (shard / "meta.json").write_text(json.dumps(meta))
    problems = verify_dataset(tmp_path, require_manifest=False)
    assert problems == [
        "shard_00000/doc_lengths.bin: row 0: documents add up to 4 tokens, the row has 5 (1 rows disagree)"
    ]


@pytest.mark.slow  # a subprocess writes a 256 MB shard
def test_the_writer_streams_rows_to_disk_so_its_memory_does_not_grow_with_the_shard(tmp_path):
    """A 256 MB shard (64M int32 tokens in 4M-token rows) is written with the process's peak
    memory under 96 MB above where it started: rows go to the shard's temp files as they come."""
    script = (
        "import resource, sys\n"
        "import numpy as np\n"
        "from tokenmill.shards.writer import ShardWriter\n"
        "row = np.arange(1 << 22, dtype=np.int32)\n"
        "start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "with ShardWriter(sys.argv[1], {'sequence': 'int32'}, 'sequence', 1 << 30) as w:\n"
        "    for _ in range(16):\n"
        "        w.add({'sequence': row})\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start) // 1024)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert int(done.stdout) < 96, f"peak grew by {done.stdout.strip()} MB"
    meta = json.loads((tmp_path / "shard_00000" / "meta.json").read_text())
    assert meta["sequence"]["shape"] == [1 << 26]
    assert verify_dataset(tmp_path, require_manifest=False) == []


def test_a_shard_spec_writes_what_its_six_fields_write(tmp_path):
    """ShardWriter takes a ShardSpec, or the spec's fields as it always has: the same shards."""
    rows = [sft_record([5, 6, 7]), sft_record([8, 9]), sft_record([1, 2, 3, 4])]
    spec = ShardSpec(tmp_path / "spec", SFT, "sequence", 4, "jsonl", 2)
    with ShardWriter(spec) as writer:
        for row in rows:
            writer.add(row)
    kw = {"max_tokens_per_shard": 4, "storage_format": "jsonl", "first_index": 2}
    with ShardWriter(tmp_path / "fields", SFT, "sequence", **kw) as writer:
        for row in rows:
            writer.add(row)
    assert tree(tmp_path / "spec") == tree(tmp_path / "fields")
    assert sorted(tree(tmp_path / "spec")) == [f"part_0000{i}.jsonl" for i in (2, 3, 4)]
    with pytest.raises(ValueError, match="storage_format 'csv' is not one of"):
        ShardSpec(tmp_path, SFT, "sequence", 4, "csv")


def columns_of(rows: list[list[int]], documents: list[list[int]] | None, positions) -> dict:
    """One shard's columns: rows of tokens, each row's stored documents, all positions."""
    lengths = [len(r) for r in rows]
    columns = {
        "sequence": Column(np.arange(sum(lengths)), np.cumsum([0, *lengths])),
    }
    if documents is not None:
        pieces = [n for row in documents for n in row]
        columns["doc_lengths"] = Column(
            np.asarray(pieces), np.cumsum([0, *(len(row) for row in documents)])
        )
    if positions is not None:
        columns["position_ids"] = Column(np.asarray(positions), np.cumsum([0, *lengths]))
    return columns


# two rows packed by `stream`: A (3 tokens), B (4: 2 in each row), C (3)
STREAM_ROWS = [[0] * 5, [0] * 5]
STREAM_PIECES = [[3, 2], [2, 3]]
STREAM_POSITIONS = [0, 1, 2, 0, 1, 2, 3, 0, 1, 2]


@pytest.mark.parametrize(
    ("documents", "positions", "marks", "lengths"),
    [
        (STREAM_PIECES, STREAM_POSITIONS, True, [3, 4, 3]),  # B's rest goes on: joined
        (None, STREAM_POSITIONS, True, [3, 4, 3]),  # no stored documents: positions tell
        (STREAM_PIECES, None, True, [3, 2, 2, 3]),  # no positions: each piece is one
        (None, None, True, [5, 5]),  # neither: each row is one
        # continuous positions count through a row: they tell nothing, the pieces do
        (STREAM_PIECES, [0, 1, 2, 3, 4, 0, 1, 2, 3, 4], False, [3, 2, 2, 3]),
        # a split piece placed apart (positions jump): a document of its own
        ([[3, 2], [2, 3]], [0, 1, 2, 5, 6, 0, 1, 0, 1, 2], True, [3, 2, 2, 3]),
    ],
)
def test_documents_start_where_pieces_do_not_go_on(documents, positions, marks, lengths):
    found = DocumentLengths(marks)
    found.add(columns_of(STREAM_ROWS, documents, positions))
    assert found.lengths().tolist() == lengths


def test_a_document_goes_on_across_shard_ends():
    """B starts at the end of the first shard and goes on in the second; a domain's
    documents are read shard after shard."""
    found = DocumentLengths()
    found.add(columns_of([[0] * 5], [[3, 2]], [0, 1, 2, 0, 1]))
    found.add(columns_of([[0] * 5], [[2, 3]], [2, 3, 0, 1, 2]))
    assert found.lengths().tolist() == [3, 4, 3]
    again = DocumentLengths()  # the same rows without stored documents
    again.add(columns_of([[0] * 5], None, [0, 1, 2, 0, 1]))
    again.add(columns_of([[0] * 5], None, [2, 3, 0, 1, 2]))
    assert again.lengths().tolist() == [3, 4, 3]


def test_the_rule_opens_a_piece_unless_its_positions_go_on_by_one():
    first = np.array([0, 4, 7, 0])
    before = np.array([NO_POSITION, 3, 3, 9])
    assert opens_document(first, before).tolist() == [True, False, True, True]
