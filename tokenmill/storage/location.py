"""Locations: a file or folder at a local path or at a URL, used the same way whichever it is.

Inputs are listed, opened, stamped and named here; outputs are checked here, and a dataset
is had as a local folder here (a URL's downloaded as it is). With the object storage client
(remote.py) and the shard sources (source.py), this is the one place that tells a URL from
a local path: the rest of tokenmill asks these functions for what it needs.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tokenmill.storage.remote import Remote, is_transient, is_url

Parts = tuple[str, ...]  # a file's path below a folder, one name per level
_LOST_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:/[^/]")
_STAMPS = tuple("ETag etag md5Hash mtime LastModified last_modified Last-Modified updated".split())


def located(path: str | Path) -> Path | str:
    """A location as it is kept and named: a local path as a Path, a URL as its string (a
    Path would merge its //)."""
    return str(path) if is_url(path) else Path(path)


# --- inputs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Folder:
    """The files below a folder: each by its path parts (names starting with "." or "_" left
    out, as pyarrow datasets do: `_SUCCESS`, `.DS_Store`), read by them, and named by them as
    a location (`join`)."""

    root: str  # the folder as messages name it: its absolute path, or its URL
    files: list[Parts]
    read: Callable[[Parts], bytes]
    join: Callable[[Parts], Path | str]


def list_location(path: str | Path) -> Path | str | Folder:
    """The file at `path` (a local one's absolute path, or its URL), or the folder there with
    its files: a local folder walked with symlinked folders followed (each real folder once),
    a URL's listed through fsspec. Nothing there raises FileNotFoundError ("input not
    found"); a URL that cannot be read, OSError naming it ("cannot read")."""
    if is_url(path):
        return _list_url(str(path))
    return _list_local(Path(path))


def _list_local(path: Path) -> Path | Folder:
    path = path.absolute()  # the same file for every process that reads it, wherever it runs
    _check_name(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"input not found: {path}")
    files = [
        p.relative_to(path).parts
        for p in _walk(path)
        if not any(part[0] in "._" for part in p.relative_to(path).parts)
    ]

    def read(parts: Parts) -> bytes:
        return path.joinpath(*parts).read_bytes()

    def join(parts: Parts) -> Path:
        return path.joinpath(*parts)

    return Folder(str(path), files, read, join)


def _check_name(path: Path) -> None:
    """A name that is not valid UTF-8 is refused: the manifest and the tasks' records name it."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        shown = str(path).encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        raise ValueError(
            f"{shown!r}: the name is not valid UTF-8; rename it (tokenmill records every "
            "input's name in the manifest)"
        ) from None


def _walk(root: Path) -> list[Path]:
    """Every file below root, symlinked folders followed (each real folder once, so a link
    back up cannot loop); a name that is not valid UTF-8 is refused, naming its folder."""
    files, seen = [], set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders.clear()
            continue
        seen.add(real)
        subfolders.sort()
        for name in [*names, *subfolders]:
            _check_name(Path(folder) / name)
        files += [Path(folder) / name for name in names if os.path.isfile(Path(folder) / name)]
    return files


def _list_url(url: str) -> str | Folder:
    fs, root = _filesystem(url)
    with _unreadable(url):
        if fs.isfile(root):
            return url
        if not fs.isdir(root):
            raise FileNotFoundError(f"input not found: {url}")
        base = root.rstrip("/")
        files = [
            tuple(parts)
            for parts in (p[len(base) + 1 :].split("/") for p in fs.find(root))
            if not any(not part or part[0] in "._" for part in parts)  # "" from a key like a//b
        ]

    def read(parts: Parts) -> bytes:
        with _unreadable(url):
            return fs.cat_file(f"{base}/{'/'.join(parts)}")

    def join(parts: Parts) -> str:
        return url.rstrip("/") + "/" + "/".join(parts)

    return Folder(url, files, read, join)


@contextlib.contextmanager
def _unreadable(url: str) -> Iterator[None]:
    """An unreachable host, a refused connection or permission, named with the URL (one line,
    whatever library raised it: fsspec's, huggingface_hub's httpx errors)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as err:
        if not is_transient(err) and not _from_os_error(err):
            raise
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"{url}: cannot read: {why}") from None


def _from_os_error(err: BaseException) -> bool:
    """An OSError (an unknown host, a refused permission), or raised because of one."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise ImportError(f"{url}: reading URLs needs fsspec: pip install fsspec") from None
    return fsspec.core.url_to_fs(url)


@contextlib.contextmanager
def open_file(path: str | Path, mapped: bool = False) -> Iterator[IO[bytes] | Any]:
    """A file's bytes, at a local path or a URL (through fsspec). `mapped`: a local file as
    pyarrow's memory map (Arrow and Parquet read it with no Python in the way, sharing its
    pages); a URL's is the same seekable file either way."""
    if is_url(path):
        fs, inner = _filesystem(str(path))
        with fs.open(inner, "rb") as file:
            yield file
    elif mapped:
        import pyarrow as pa

        with pa.memory_map(str(path)) as file:
            yield file
    else:
        with open(path, "rb") as file:
            yield file


def file_stamp(path: str | Path) -> tuple[int, str]:
    """(bytes, modification stamp) of a file: mtime in ns for a local one; for a URL, what
    its filesystem keeps (the ETag or last-modified time of the object)."""
    if not is_url(path):
        stat = Path(path).stat()
        return stat.st_size, str(stat.st_mtime_ns)
    fs, inner = _filesystem(str(path))
    info = fs.info(inner)
    if info.get("size") is None:
        raise ValueError(f"{path}: its filesystem does not report its size; cannot read it")
    return int(info["size"]), next((str(info[k]) for k in _STAMPS if info.get(k)), "")


def file_name(path: str | Path) -> str:
    """A file's name: the last part of its path, or of its URL's (its query left out:
    `https://.../x.jsonl?sig=...` is x.jsonl)."""
    text = str(path).split("?", 1)[0] if is_url(path) else str(path)
    return text.rstrip("/").rsplit("/", 1)[-1]


# --- outputs ------------------------------------------------------------------------------
def output_folder(path: str | Path) -> Path:
    """A local output folder, refused at once when it is a URL or a file is in its place."""
    if is_url(path):
        raise ValueError(f"output {path}: this command writes a local folder, not a URL")
    out = Path(path)
    for folder in (out, *out.absolute().parents):
        if folder.exists() and not folder.is_dir():
            where = "" if folder == out else f": {folder}"
            raise NotADirectoryError(f"output {out}{where} is a file, not a folder")
    return out


def output_location(
    path: str | Path, storage_options: dict[str, Any] | None = None
) -> Path | Remote:
    """Where a run writes: a URL's client (`storage_options` go to fsspec), or the local
    folder's absolute Path (`output_folder`'s checks; a URL that lost a slash to a Path,
    `s3:/bucket`, refused)."""
    if is_url(path):
        return Remote(str(path), storage_options)
    if _LOST_SLASH.match(str(path)):
        raise ValueError(
            f"output {str(path)!r} looks like a URL that lost a slash (a Path merges //); "
            "pass the URL as a string"
        )
    return output_folder(path).absolute()  # Ray workers and tools run from other folders


# --- datasets -----------------------------------------------------------------------------
@contextlib.contextmanager
def dataset_folder(
    dataset: str | Path, storage_options: dict[str, Any] | None = None
) -> Iterator[tuple[Path, Callable[[str], str]]]:
    """A dataset as a local folder, and what names a path of it in messages: a local folder
    as it is; a URL's every object downloaded as it is (nothing checked on the way, so that
    `verify` finds what is wrong) to a temporary folder, removed after, its paths named by
    the URL's."""
    if not is_url(dataset):
        yield Path(dataset), str
        return
    remote = Remote(str(dataset), storage_options)
    listing = remote.listing()
    if not listing:
        raise FileNotFoundError(f"{remote.url}: no object below it")
    with tempfile.TemporaryDirectory(prefix="tokenmill-copy-") as tmp:
        root = Path(tmp) / "dataset"
        pairs = [(rel, root / rel) for rel in sorted(listing)]
        for _, path in pairs:
            path.parent.mkdir(parents=True, exist_ok=True)
        remote.get(pairs, [listing[rel] for rel, _ in pairs])

        def named(text: str) -> str:
            return text.replace(str(root), remote.url)

        yield root, named
