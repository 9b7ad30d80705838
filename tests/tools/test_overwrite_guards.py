"""--overwrite deletes only what tokenmill can prove it wrote (issue 39): an output is known
by a manifest naming tokenmill and its dataset, or a run folder holding a run id, never by a
file name; paths are compared with their links resolved; for preprocess, export and import,
local and in a bucket. Anything else is refused with the reason, and left as it was."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import DATA, QWEN

from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.tools.cli import main


def _input(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    with open(DATA / "pretrain_c4_300.jsonl", encoding="utf-8") as f:
        src.write_text("".join(next(f) for _ in range(5)))
    return src


def _web_app(folder: Path) -> dict[str, str]:
    """A folder that is not tokenmill's but has its file names: a web app's manifest.json."""
    files = {"manifest.json": '{"name":"app"}', "src/app.js": "console.log(1)"}
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return files


def _files(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): p.read_text(errors="replace")
        for p in folder.rglob("*")
        if p.is_file()
    }


def _preprocess(src: Path, out: Path, *extra: str) -> int:
    argv = ["preprocess", str(src), "-o", str(out), "--type", "seq", "--tokenizer", str(QWEN)]
    return main([*argv, "--workers", "1", *extra])


def test_overwrite_refuses_a_web_app_folder_with_a_manifest_json(tmp_path, capsys):
    """The issue's repro: `site/manifest.json` holding `{"name":"app"}` made the folder look
    like an output; now the run exits 2 naming why and `site/src/app.js` is still there."""
    site = tmp_path / "site"
    files = _web_app(site)
    assert _preprocess(_input(tmp_path), site, "--overwrite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tokenmill: error: ")
    assert f"{site} is not a tokenmill output (its manifest.json names the tool None" in err
    assert _files(site) == files


@pytest.mark.parametrize(
    ("manifest", "why"),
    [
        ("[1, 2]", "its manifest.json holds a JSON list, not a tokenmill manifest"),
        ("not json", "its manifest.json is not JSON"),
        ('{"tool": "tokenmill 0.1"}', "names no tokenmill run id or import source"),
        ('{"tool": "webpack", "run_id": "' + "a" * 64 + '"}', "names the tool 'webpack'"),
    ],
)
def test_overwrite_refuses_a_manifest_that_is_not_tokenmills(tmp_path, capsys, manifest, why):
    """A manifest.json holding a list (a traceback before), or an object that does not name
    tokenmill and a dataset: one error line, exit 2, nothing removed."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(manifest)
    (out / "keep.txt").write_text("mine")
    assert _preprocess(_input(tmp_path), out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and why in err, err
    assert _files(out) == {"manifest.json": manifest, "keep.txt": "mine"}


def test_overwrite_refuses_a_folder_whose_run_folder_has_no_run_id(tmp_path, capsys):
    """An empty `.tokenmill-run/` beside a user's files proves nothing."""
    out = tmp_path / "out"
    (out / ".tokenmill-run").mkdir(parents=True)
    (out / "keep.txt").write_text("mine")
    assert _preprocess(_input(tmp_path), out, "--overwrite") == 2
    assert "it has no manifest.json and no .tokenmill-run/run_id" in capsys.readouterr().err
    assert _files(out) == {"keep.txt": "mine"}
    (out / ".tokenmill-run" / "run_id").write_text("not an id")
    assert _preprocess(_input(tmp_path), out, "--overwrite") == 2
    assert "its .tokenmill-run/run_id is not a tokenmill run id" in capsys.readouterr().err


def test_overwrite_replaces_a_tokenmill_output_and_an_interrupted_run(tmp_path):
    """What tokenmill wrote is still replaced: a finished output (its manifest), and an
    interrupted run (its run folder's id only)."""
    src, out = _input(tmp_path), tmp_path / "out"
    assert _preprocess(src, out) == 0
    (out / "stray.txt").write_text("x")
    assert _preprocess(src, out, "--overwrite") == 0
    assert "stray.txt" not in _files(out)
    interrupted = tmp_path / "interrupted"
    (interrupted / ".tokenmill-run").mkdir(parents=True)
    (interrupted / ".tokenmill-run" / "run_id").write_text("0" * 64)
    (interrupted / "shard_00000.tmp-1").mkdir()
    assert _preprocess(src, interrupted, "--overwrite") == 0
    assert (interrupted / "manifest.json").is_file()


def test_an_input_linked_into_the_output_is_refused_before_anything_is_removed(tmp_path):
    """The guard resolves links: an input reached through a link outside the output, whose
    file is inside it, is the output's; the run is refused and the file kept."""
    out = tmp_path / "out"
    assert _preprocess(_input(tmp_path), out) == 0
    inside = out / "data.jsonl"
    inside.write_text(_input(tmp_path).read_text())
    link = tmp_path / "link.jsonl"
    link.symlink_to(inside)
    with pytest.raises(ValueError, match=f"{out} contains the input {link}"):
        Pipeline(default_config("seq"), [link], out, QWEN, workers=1, overwrite=True).run()
    assert inside.exists()
    linked_out = tmp_path / "linked_out"  # the output named through a link
    linked_out.symlink_to(out)
    with pytest.raises(ValueError, match="contains the input"):
        Pipeline(default_config("seq"), [inside], linked_out, QWEN, workers=1, overwrite=True).run()
    assert inside.exists()


def test_export_hf_overwrite_refuses_a_datasets_folder_it_did_not_write(tmp_path, capsys):
    """Any saved `datasets` folder has a state.json; only one whose dataset_info.json says
    tokenmill exported it is replaced. An export over its own dataset is refused."""
    src, ds = _input(tmp_path), tmp_path / "ds"
    assert _preprocess(src, ds) == 0
    other = tmp_path / "other"
    other.mkdir()
    files = {"state.json": "{}", "dataset_info.json": '{"description": "mine"}', "a.arrow": "x"}
    for name, text in files.items():
        (other / name).write_text(text)
    argv = ["export", str(ds), "--to", "hf", "-o", str(other), "--overwrite"]
    assert main(argv) == 2
    assert "does not say tokenmill exported it" in capsys.readouterr().err
    assert _files(other) == files
    (other / "state.json").unlink()
    assert main(argv) == 2
    assert "no state.json and dataset_info.json" in capsys.readouterr().err
    export = tmp_path / "export"
    assert main(["export", str(ds), "--to", "hf", "-o", str(export)]) == 0
    (export / "stray").write_text("x")
    assert main(["export", str(ds), "--to", "hf", "-o", str(export), "--overwrite"]) == 0
    assert not (export / "stray").exists()
    assert main(["export", str(ds), "--to", "hf", "-o", str(tmp_path), "--overwrite"]) == 2
    assert f"{tmp_path} holds the dataset {ds}" in capsys.readouterr().err
    assert (ds / "manifest.json").is_file()


def test_import_overwrite_refuses_what_tokenmill_did_not_write(tmp_path, capsys):
    """import --overwrite: a web app's folder is refused; an earlier import is replaced; an
    output holding the corpus itself is refused."""
    src, ds = _input(tmp_path), tmp_path / "ds"
    assert _preprocess(src, ds) == 0
    prefix = tmp_path / "corpus"
    assert main(["export", str(ds), "--to", "megatron", "-o", str(prefix)]) == 0
    site = tmp_path / "site"
    files = _web_app(site)
    assert main(["import", str(prefix), "-o", str(site), "--overwrite"]) == 2
    assert "names the tool None" in capsys.readouterr().err
    assert _files(site) == files
    imported = tmp_path / "imported"
    assert main(["import", str(prefix), "-o", str(imported)]) == 0
    (imported / "stray").write_text("x")
    assert main(["import", str(prefix), "-o", str(imported), "--overwrite"]) == 0
    assert not (imported / "stray").exists()
    assert json.loads((imported / "manifest.json").read_text())["source"]["format"] == "megatron"
    assert main(["import", str(prefix), "-o", str(tmp_path), "--overwrite"]) == 2
    assert "holds the corpus" in capsys.readouterr().err
    assert prefix.with_suffix(".bin").exists()


@pytest.fixture
def options(monkeypatch) -> Iterator[dict]:
    """A bucket on a real S3 server on loopback (moto's, as tests/remote/ runs it): the
    storage options that reach it."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(key, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        import boto3

        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="guards")
        yield {"endpoint_url": endpoint}
    finally:
        server.stop()


@pytest.mark.slow  # an S3 server
def test_bucket_overwrite_refuses_a_prefix_that_is_not_tokenmills(tmp_path, options):
    """The same proof in a bucket: a prefix holding a web app's manifest.json and an app is
    refused and kept; a tokenmill output there is replaced."""
    from tokenmill.storage.remote import Remote

    url = "s3://guards/site"
    remote = Remote(url, options)
    remote.pipe("manifest.json", b'{"name":"app"}')
    remote.pipe("src/app.js", b"console.log(1)")
    src = _input(tmp_path)
    run = lambda: Pipeline(  # noqa: E731
        default_config("seq"),
        [src],
        url,
        QWEN,
        workers=1,
        overwrite=True,
        storage_options=options,
        staging_dir=tmp_path / "staging",
    ).run()
    with pytest.raises(FileExistsError, match="names the tool None, not tokenmill"):
        run()
    assert sorted(remote.listing()) == ["manifest.json", "src/app.js"]
    remote.remove(["manifest.json", "src/app.js"])
    remote.pipe(".tokenmill-run/inputs.json", b"[]")  # a run folder without its id
    remote.pipe("notes.txt", b"mine")
    with pytest.raises(FileExistsError, match="no manifest.json and no .tokenmill-run/run_id"):
        run()
    assert remote.cat("notes.txt") == b"mine"
    remote.remove([".tokenmill-run/inputs.json", "notes.txt"])
    run()
    remote.pipe("stray.txt", b"x")
    run()
    assert "stray.txt" not in remote.listing()
    assert "manifest.json" in remote.listing()
