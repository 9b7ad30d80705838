"""A real S3-protocol server for the remote tests: moto's standalone server on loopback,
reached through the same client code (fsspec, s3fs) a user runs, with a fresh bucket per
test, and a proxy in front of it that drops connections on demand (fault injection)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from bucket_helpers import QWEN, SOURCES, small_config, source

from tokenmill.preprocess.run.pipeline import Pipeline
from tokenmill.storage import remote as remote_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a moto server; credentials and region set for botocore."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def bucket(s3_server) -> str:
    """A new empty bucket's name."""
    import boto3

    name = f"tm-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return name


@pytest.fixture
def options(s3_server) -> dict:
    """The storage options a user passes for an S3-compatible store."""
    return {"endpoint_url": s3_server}


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    """Backoff in milliseconds: the tests check that retries happen, not how long they wait."""
    monkeypatch.setattr(remote_module, "RETRY_BASE_S", 0.01)
    monkeypatch.setattr(remote_module, "RETRY_MAX_S", 0.05)


class DroppingProxy:
    """A TCP proxy to the server that drops connections while `dropping` is set, `burst` in a
    row of every `every`, starting with the first (two in a row get past the HTTP client's own
    silent retry of a fresh connection; the first ones are a job's first request, which no
    other runs beside, so two of its tries are cut whatever runs in parallel later): with `after` = 0 a connection is closed as soon as it opens; else a
    request's reply is cut after `after` bytes (its headers through, its body not). `dropped`
    counts the cuts. It stops cutting before one request could lose all of the client's 6
    tries, however requests made in parallel line up with the cuts: after 5 cut replies (each
    costs a try), or 11 closed connections (the HTTP client silently retries one of each two)."""

    def __init__(self, target_port: int, every: int = 8, burst: int = 2, after: int = 0):
        self.target_port, self.every, self.burst, self.after = target_port, every, burst, after
        self.dropping = threading.Event()
        self.dropped = self.connections = self.requests = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _chosen(self, count: int) -> bool:
        limit = 5 if self.after else 11
        return (
            self.dropping.is_set()
            and self.dropped < limit
            and (count - 1) % self.every < self.burst
        )

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.after == 0 and self._chosen(self.connections):
                self.dropped += 1
                client.close()
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        state = {"sent": 0, "cut_at": None, "replying": True}

        def close() -> None:
            for s in (client, server):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

        def requests() -> None:  # client -> server: each new request may get its reply cut
            try:
                while data := client.recv(65536):
                    if state["replying"] and self.after:
                        state["replying"] = False
                        with self.lock:
                            self.requests += 1
                            chosen = self._chosen(self.requests)
                        state["cut_at"] = state["sent"] + self.after if chosen else None
                    server.sendall(data)
            except OSError:
                pass
            close()

        threading.Thread(target=requests, daemon=True).start()
        try:
            while data := server.recv(65536):
                state["replying"] = True
                cut = state["cut_at"]
                if cut is not None and state["sent"] + len(data) > cut:
                    client.sendall(data[: max(0, cut - state["sent"])])
                    self.dropped += 1
                    break
                client.sendall(data)
                state["sent"] += len(data)
        except OSError:
            pass
        close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


@pytest.fixture
def proxy(s3_server) -> Iterator[DroppingProxy]:
    p = DroppingProxy(int(s3_server.rsplit(":", 1)[1]))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def datasets(s3_server, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """sft and seq datasets, each written once locally and once to a bucket by the local
    engine: train type -> (local folder, URL)."""
    import boto3

    folder = tmp_path_factory.mktemp("datasets")
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket="datasets")
    out = {}
    for train_type in SOURCES:
        src = source(train_type, folder)
        cfg = small_config(train_type)
        local = folder / train_type
        Pipeline(cfg, [src], local, QWEN, workers=1, on_error="skip", progress=False).run()
        url = f"s3://datasets/{train_type}"
        Pipeline(
            cfg,
            [src],
            url,
            QWEN,
            workers=1,
            on_error="skip",
            progress=False,
            storage_options={"endpoint_url": s3_server},
            staging_dir=folder / "staging",
        ).run()
        out[train_type] = (local, url)
    return out
