"""Hugging Face `datasets` as preprocessing input: Dataset and IterableDataset objects, and the
folders datasets writes (save_to_disk, to_parquet, the Hub's data/<split>-*.parquet), checked
with datasets itself: each gives the bytes its JSONL gives."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pytest
from helpers import DATA, QWEN

from tokenmill import Pipeline, default_config
from tokenmill.preprocess.inputs.files import input_identity, list_inputs
from tokenmill.preprocess.inputs.hf import DatasetInput
from tokenmill.preprocess.inputs.records import RecordError, read_records
from tokenmill.tools.cli import main

ROWS = [json.loads(x) for x in (DATA / "pretrain_c4_300.jsonl").read_text().split("\n") if x][:40]


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "manifest.json"
    }


def run(inputs, out: Path, **kw) -> Path:
    Pipeline(default_config("seq"), inputs, out, QWEN, workers=1, **kw).run()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("ref")
    src = root / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return files_of(run([src], root / "out"))


def test_a_dataset_object_gives_the_bytes_of_its_jsonl(reference, tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    given = {
        "bare": ds,
        "listed": [ds],
        "iterable": ds.to_iterable_dataset(num_shards=2),
        "torch_format": ds.with_format("torch"),  # the user's format is left aside
    }
    for name, inputs in given.items():
        out = run(inputs, tmp_path / name)
        assert files_of(out) == reference, name
        named = "IterableDataset#1" if name == "iterable" else "Dataset#1"
        assert json.loads((out / "manifest.json").read_text())["inputs"] == [named]


def test_folders_written_by_datasets_give_the_same_bytes(reference, tmp_path, capsys):
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"), num_shards=3)
    hub = tmp_path / "hub"
    (hub / "data").mkdir(parents=True)
    ds.to_parquet(str(hub / "data" / "train-00000-of-00001.parquet"))
    (hub / "README.md").write_text("---\nlicense: odc-by\n---\n# a dataset card\n")
    (hub / ".gitattributes").write_text("*.parquet filter=lfs\n")
    assert [p.name for p in list_inputs([tmp_path / "saved"])] == [
        f"data-0000{i}-of-00003.arrow" for i in range(3)
    ]
    for folder in ("saved", "hub"):
        out = tmp_path / f"out_{folder}"
        argv = ["preprocess", str(tmp_path / folder), "-o", str(out), "--type", "seq"]
        assert main([*argv, "--tokenizer", str(QWEN), "--workers", "1"]) == 0
        assert files_of(out) == reference, folder
    capsys.readouterr()


def test_arrow_files_of_both_ipc_formats_are_read_in_slices(tmp_path):
    table = pa.Table.from_pylist([{"text": f"row {i}"} for i in range(2500)])
    for name, open_writer in (("stream.arrow", pa.ipc.new_stream), ("file.arrow", pa.ipc.new_file)):
        with pa.OSFile(str(tmp_path / name), "wb") as sink, open_writer(sink, table.schema) as w:
            w.write_table(table, max_chunksize=2000)
        records = list(read_records(tmp_path / name))
        assert [r.data["text"] for r in records] == [f"row {i}" for i in range(2500)]
        assert [r.line for r in records] == list(range(1, 2501))


def test_a_bad_row_is_named_by_its_dataset_and_row(tmp_path):
    rows = [{"text": r["text"]} for r in ROWS[:6]]
    rows[3]["text"] = None  # a typed column's bad value: null
    info = datasets.DatasetInfo(dataset_name="c4")
    ds = datasets.Dataset.from_list(rows, info=info, split="train")
    with pytest.raises(RecordError) as caught:
        run(ds, tmp_path / "out")
    assert str(caught.value).startswith("Dataset#1(c4/train):4: text: ")
    summary = Pipeline(
        default_config("seq"), ds, tmp_path / "skip", QWEN, workers=1, on_error="skip"
    ).run()
    assert summary.records_written == 5
    reject = json.loads((tmp_path / "skip" / "rejects.jsonl").read_text().splitlines()[0])
    assert (reject["source"], reject["line"], reject["field"]) == ("Dataset#1(c4/train)", 4, "text")


def test_what_is_not_one_input_is_refused_by_name(tmp_path):
    ds = datasets.Dataset.from_list(ROWS[:4])
    splits = datasets.DatasetDict({"train": ds, "test": ds})
    with pytest.raises(ValueError, match=r"a DatasetDict \(splits: train, test\); pass one split"):
        list_inputs([splits])
    splits.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"DatasetDict saved by datasets .* such as .*dict/train"):
        list_inputs([tmp_path / "dict"])
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    for split in ("train", "test"):
        ds.to_parquet(str(hub / f"{split}-00000-of-00001.parquet"))
    with pytest.raises(ValueError, match=r"splits test, train .* such as .*hub/data/train-\*"):
        list_inputs([tmp_path / "hub"])
    with pytest.raises(TypeError, match="input 2: expected a path, a URL or .*got dict"):
        list_inputs([ds, {"text": "a record, not an input"}])
    with pytest.raises(ValueError, match="listed twice"):
        list_inputs([ds, ds])


def test_rows_are_streamed_not_loaded_whole():
    made = []

    def rows():
        for i in range(10_000):
            made.append(i)
            yield {"text": f"row {i}"}

    stream = datasets.IterableDataset.from_generator(rows)
    first = next(read_records(DatasetInput(stream, 1)))
    assert first.data == {"text": "row 0"} and first.line == 1
    assert len(made) < 5_000


def test_a_saved_dataset_keeps_its_identity_and_a_finished_run_is_not_redone(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    first = datasets.load_from_disk(str(tmp_path / "saved"))
    again = datasets.load_from_disk(str(tmp_path / "saved"))
    assert input_identity(DatasetInput(first, 1)) == input_identity(DatasetInput(again, 1))
    stream = first.to_iterable_dataset()
    assert input_identity(DatasetInput(stream, 1)) != input_identity(DatasetInput(stream, 1))
    out = run(first, tmp_path / "out")
    before = files_of(out)
    summary = Pipeline(default_config("seq"), again, out, QWEN, workers=1).run()  # same job: done
    assert summary.records_written == len(ROWS) and files_of(out) == before


def test_the_ray_engine_reads_saved_datasets_and_refuses_objects(reference, tmp_path):
    ds = datasets.Dataset.from_list(ROWS)
    with pytest.raises(ValueError, match="ray engine reads input files.*save_to_disk"):
        run(ds, tmp_path / "refused", engine="ray")
    assert not (tmp_path / "refused").exists()


@pytest.mark.slow  # starts Ray
def test_the_ray_engine_gives_the_same_bytes_from_a_saved_dataset(reference, tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"), num_shards=2)
    assert files_of(run(tmp_path / "saved", tmp_path / "out", engine="ray")) == reference
