"""Tokenizers by Hub name: ORG/NAME[@REVISION] resolved from a local Hugging Face cache, offline.

The cache is laid out as huggingface_hub lays it out when it downloads (and as its own
`scan_cache_dir` reads it back): `models--ORG--NAME/blobs/<hash>` holding the files, each
revision a `snapshots/<commit>/` folder of relative symlinks into blobs/, and `refs/<branch>`
holding a commit hash. It holds the shipped tokenizers: qwen2.5 at main (and tag v1), qwen3
at an older commit, so that which revision was read shows in the tokenizer's fingerprint.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers import DATA, QWEN, ROOT, TOKENIZERS
from huggingface_hub import scan_cache_dir

from tokenmill.preprocess.chat.tokenizer import load_tokenizer, tokenizer_folder
from tokenmill.preprocess.presets import default_config
from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.tools.cli import main
from tokenmill.training.dataset_factory import DatasetFactory

NAME = "Qwen/Qwen2.5-0.5B-Instruct"
MAIN = "7ae557604adf67be50417f59c2c2f167def9a775"  # qwen2.5 (main, tag v1)
OLD = "aa8e72537993ba99e69dfaafa59ed015b17504d1"  # qwen3, an older commit no ref names


def git_blob_id(data: bytes) -> str:
    """A file's id in git, the name the Hub gives a regular (not LFS) file's blob."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo: str, commit: str, source: Path) -> Path:
    """`source`'s files as revision `commit` of `repo`: blobs + a snapshot of symlinks."""
    stored = cache / f"models--{repo.replace('/', '--')}"
    (stored / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = stored / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        # tokenizer.json is an LFS file on the Hub (blob named by its sha256), the config not
        lfs = file.name == "tokenizer.json"
        blob = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        (stored / "blobs" / blob).write_bytes(data)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def set_ref(cache: Path, repo: str, ref: str, commit: str) -> None:
    path = cache / f"models--{repo.replace('/', '--')}" / "refs" / ref
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(commit)  # no newline, as huggingface_hub writes it


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf") / "hub"
    add_snapshot(root, NAME, MAIN, QWEN)
    add_snapshot(root, NAME, OLD, TOKENIZERS / "qwen3")
    set_ref(root, NAME, "main", MAIN)
    set_ref(root, NAME, "v1", MAIN)
    return root


@pytest.fixture
def hub(cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """HF_HUB_CACHE at the cache, and the working folder an empty one (no folder of NAME)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return cache / f"models--{NAME.replace('/', '--')}" / "snapshots" / commit


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(cache: Path):
    (repo,) = scan_cache_dir(cache).repos
    assert (repo.repo_id, repo.repo_type) == (NAME, "model")
    assert {r.commit_hash: set(r.refs) for r in repo.revisions} == {
        MAIN: {"main", "v1"},
        OLD: set(),
    }
    assert all(f.file_path.is_symlink() for r in repo.revisions for f in r.files)


def test_a_name_loads_the_snapshot_its_main_ref_names(hub: Path):
    assert tokenizer_folder(NAME) == snapshot(hub, MAIN)
    bundle = load_tokenizer(NAME)
    assert bundle.path == str(snapshot(hub, MAIN).resolve())
    assert bundle.fingerprint == load_tokenizer(QWEN).fingerprint
    assert bundle.tokenizer.encode("Hello world").ids == [9707, 1879]


@pytest.mark.parametrize(
    ("revision", "commit", "shipped"),
    [
        ("main", MAIN, "qwen2.5"),
        ("v1", MAIN, "qwen2.5"),
        (OLD, OLD, "qwen3"),
        (MAIN, MAIN, "qwen2.5"),
    ],
)
def test_a_revision_is_a_ref_or_a_commit(hub: Path, revision: str, commit: str, shipped: str):
    assert tokenizer_folder(f"{NAME}@{revision}") == snapshot(hub, commit)
    fingerprint = load_tokenizer(TOKENIZERS / shipped).fingerprint
    assert load_tokenizer(f"{NAME}@{revision}").fingerprint == fingerprint


def test_a_folder_of_that_path_wins(hub: Path, tmp_path: Path):
    local = tmp_path / NAME
    local.mkdir(parents=True)
    for file in (TOKENIZERS / "qwen3").iterdir():
        (local / file.name).write_bytes(file.read_bytes())
    assert tokenizer_folder(NAME) == local
    assert load_tokenizer(NAME).fingerprint == load_tokenizer(TOKENIZERS / "qwen3").fingerprint


def test_a_path_that_is_no_name_stays_a_path(hub: Path, tmp_path: Path):
    for path in ("tok", "./Qwen/x", "a/b/c", f"{NAME}@"):
        assert tokenizer_folder(path) == tmp_path / path
        with pytest.raises(FileNotFoundError, match="tokenizer.json: not found"):
            load_tokenizer(path)


def test_a_missing_name_is_refused_naming_the_paths_searched(hub: Path, tmp_path: Path):
    stored = hub / "models--Qwen--Qwen9-Missing"
    with pytest.raises(FileNotFoundError) as raised:
        load_tokenizer("Qwen/Qwen9-Missing")
    message = str(raised.value)
    for part in (
        "'Qwen/Qwen9-Missing'",
        f"no such folder ({tmp_path / 'Qwen' / 'Qwen9-Missing'})",
        f"Hugging Face cache {hub} ($HF_HUB_CACHE)",
        f"searched {stored / 'refs' / 'main'}, {stored / 'snapshots'}",
        "hf download Qwen/Qwen9-Missing",
    ):
        assert part in message, message


def test_a_missing_revision_names_its_ref_or_its_snapshot(hub: Path):
    stored = hub / "models--Qwen--Qwen2.5-0.5B-Instruct"
    with pytest.raises(FileNotFoundError, match=str(stored / "refs" / "v2").replace(".", r"\.")):
        load_tokenizer(f"{NAME}@v2")
    commit = "0" * 40
    with pytest.raises(FileNotFoundError) as raised:
        load_tokenizer(f"{NAME}@{commit}")
    assert f"searched {stored / 'snapshots' / commit}. " in str(raised.value)


@pytest.mark.parametrize(
    ("environment", "cache", "chosen_by"),
    [
        ({"HF_HOME": "{tmp}/home"}, "{tmp}/home/hub", "$HF_HOME"),
        ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/huggingface/hub", "$XDG_CACHE_HOME"),
        ({"HOME": "{tmp}/user"}, "{tmp}/user/.cache/huggingface/hub", "the default"),
    ],
)
def test_the_cache_is_where_huggingface_hub_looks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, environment: dict, cache: str, chosen_by: str
):
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in environment.items():
        monkeypatch.setenv(variable, value.format(tmp=tmp_path))
    monkeypatch.chdir(tmp_path)
    where = Path(cache.format(tmp=tmp_path))
    with pytest.raises(
        FileNotFoundError, match=f"cache {where} \\({chosen_by.replace('$', '.')}\\)"
    ):
        load_tokenizer(NAME)
    add_snapshot(where, NAME, MAIN, QWEN)
    set_ref(where, NAME, "main", MAIN)
    assert tokenizer_folder(NAME) == snapshot(where, MAIN)


def shard_files(output: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(output)): p.read_bytes()
        for p in sorted(output.rglob("*"))
        if p.is_file() and p.name != "manifest.json" and "run" not in p.relative_to(output).parts[0]
    }


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    with open(DATA / "chat_sharegpt_1000.jsonl", encoding="utf-8") as f:
        path.write_text("".join(next(f) for _ in range(30)))
    return path


def test_a_run_by_name_writes_what_a_run_by_folder_writes(hub: Path, chats: Path, tmp_path: Path):
    runs = {}
    for label, tokenizer in (("name", NAME), ("folder", QWEN)):
        Pipeline(
            default_config("sft"), [chats], tmp_path / label, tokenizer, workers=1, progress=False
        ).run()
        runs[label] = json.loads((tmp_path / label / "manifest.json").read_text())
    by_name, by_folder = runs["name"], runs["folder"]
    assert by_name["tokenizer_name"] == NAME
    assert by_name["tokenizer_path"] == str(snapshot(hub, MAIN))
    assert "tokenizer_name" not in by_folder and by_folder["tokenizer_path"] == str(QWEN)
    assert by_name["fingerprint"] == by_folder["fingerprint"]
    assert by_name["summary"]["records_written"] == 30
    written = shard_files(tmp_path / "name")
    assert any(k.endswith("sequence.bin") for k in written)
    assert written == shard_files(tmp_path / "folder")


def test_the_cli_takes_a_name(hub: Path, chats: Path, tmp_path: Path, capsys):
    argv = ["preprocess", str(chats), "-o", "out", "--type", "sft", "--tokenizer", f"{NAME}@v1"]
    assert main(argv + ["--workers", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records_written"] == 30
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert (manifest["tokenizer_name"], manifest["tokenizer_path"]) == (
        f"{NAME}@v1",
        str(snapshot(hub, MAIN)),
    )
    rows = DatasetFactory.load("sft", tmp_path / "out", window_size=4096)
    ids = rows[0]["input_ids"][:3].tolist()
    assert (
        load_tokenizer(QWEN).tokenizer.decode(ids, skip_special_tokens=False)
        == "<|im_start|>system\n"
    )


def test_the_cli_names_the_paths_of_a_missing_name(hub: Path, chats: Path, capsys):
    argv = ["preprocess", str(chats), "-o", "out", "--type", "sft", "--tokenizer", "Qwen/Nope"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    stored = hub / "models--Qwen--Nope"
    assert err.startswith("tokenmill: error: "), err
    assert f"searched {stored / 'refs' / 'main'}, {stored / 'snapshots'}" in err
    assert "Traceback" not in err


def test_a_dataset_of_raw_records_takes_a_name(hub: Path):
    pairs = DATA / "dpo_en_300.jsonl"
    by_name = DatasetFactory.load("dpo", pairs, window_size=2048, tokenizer_path=NAME)
    by_folder = DatasetFactory.load("dpo", pairs, window_size=2048, tokenizer_path=QWEN)
    for i in (0, 7):
        for key, value in by_folder[i].items():
            assert np.array_equal(np.asarray(by_name[i][key]), np.asarray(value)), key


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.seen.append(self.path)
        self.send_response(500)
        self.end_headers()

    do_HEAD = do_POST = do_GET  # noqa: N815

    def log_message(self, *args: object) -> None:
        pass


def test_resolving_a_name_makes_no_network_call(hub: Path, chats: Path, tmp_path: Path):
    """Online mode, the Hub endpoint a loopback server that records every request: a run by
    name succeeds and the server saw none. A subprocess, as huggingface_hub reads its
    endpoint and offline flag once, on import."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
        "HF_HUB_CACHE": str(hub),
        "PYTHONPATH": str(ROOT),  # this checkout's tokenmill
    }
    argv = ["preprocess", str(chats), "-o", "out", "--type", "sft", "--tokenizer", NAME]
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tokenmill", *argv, "--workers", "1"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert manifest["tokenizer_path"] == str(snapshot(hub, MAIN))
        assert _Recorder.seen == []
        # the server answers: a client that asked would have been seen
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                f"import urllib.request as u; u.urlopen('{env['HF_ENDPOINT']}/x')",
            ],
            capture_output=True,
        )
        assert probe.returncode != 0 and _Recorder.seen == ["/x"]
    finally:
        server.shutdown()
        server.server_close()
