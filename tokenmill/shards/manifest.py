"""manifest.json: the dataset's table of contents, written last, so its presence means complete."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenmill.shards.files import write_atomic
from tokenmill.shards.format import FORMAT_VERSION, RUN_DIR


def write_manifest(root: Path, manifest: dict) -> None:
    """Writes manifest.json atomically (temp + os.replace): its presence means the dataset is complete."""
    domains = manifest.get("domains", {})
    if not isinstance(domains, dict) or not all(isinstance(v, list) for v in domains.values()):
        raise ValueError(
            "manifest 'domains' must map a domain folder ('' for the root) to a list of shard infos"
        )
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    write_atomic(Path(root) / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())


def listed(manifest: dict) -> list[tuple[str, dict]]:
    """(path below the dataset folder, info) of every shard or part the manifest lists."""
    return [
        (f"{domain}/{info['name']}" if domain else info["name"], info)
        for domain, infos in manifest.get("domains", {}).items()
        for info in infos
    ]


def read_manifest(root: Path) -> dict | None:
    """A dataset folder's manifest.json (`parse_manifest`), None where it has none."""
    path = Path(root) / "manifest.json"
    if not path.exists():
        return None
    return parse_manifest(path.read_bytes(), path)


def parse_manifest(data: bytes, where: str | Path) -> dict:
    """manifest.json's bytes, wherever they were read (a folder, a bucket), refused when they
    are not a JSON object or were written by a newer tokenmill (its format_version); `where`
    names the file in messages."""
    try:
        manifest = json.loads(data)
    except ValueError as err:
        raise ValueError(f"{where}: not valid JSON: {err}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(manifest).__name__}")
    version = manifest.get("format_version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"{where}: format_version must be an integer, got {version!r}")
    if version > FORMAT_VERSION:
        raise ValueError(
            f"{where}: format_version {manifest['format_version']} is newer than this "
            f"tokenmill reads ({FORMAT_VERSION}); upgrade tokenmill"
        )
    return manifest


def not_ours(manifest: bytes | None, run_id: bytes | None) -> str | None:
    """Why a folder or prefix is not proven a tokenmill output (None where it is), from its
    manifest.json's bytes and its run folder's `run_id` (None where absent): what --overwrite
    may delete. A file name proves nothing (a web app has a manifest.json): a manifest must be
    a JSON object naming tokenmill as its tool and its dataset (a run id, or the source it
    was imported from); a run folder must hold the id a run writes there."""
    if manifest is not None:
        try:
            data = json.loads(manifest)
        except ValueError:
            return "its manifest.json is not JSON"
        if not isinstance(data, dict):
            return f"its manifest.json holds a JSON {type(data).__name__}, not a tokenmill manifest"
        tool = data.get("tool")
        if not (isinstance(tool, str) and tool.startswith("tokenmill ")):
            return f"its manifest.json names the tool {tool!r}, not tokenmill"
        if not (_is_run_id(data.get("run_id")) or isinstance(data.get("source"), dict)):
            return "its manifest.json names no tokenmill run id or import source"
        return None
    if run_id is not None:
        return (
            None
            if _is_run_id(run_id.decode(errors="replace"))
            else (f"its {RUN_DIR}/run_id is not a tokenmill run id")
        )
    return f"it has no manifest.json and no {RUN_DIR}/run_id"


def _is_run_id(value: object) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


def refuse_split_root(where: str | Path, manifest: dict | None) -> None:
    """A run with a validation split writes `train/` and `validation/`, each a dataset with
    its own manifest; loading their root would train on the held-out records too."""
    if not isinstance(manifest, dict) or "split" in manifest:
        return
    preprocessing = (manifest.get("config") or {}).get("preprocessing") or {}
    if isinstance(preprocessing, dict) and preprocessing.get("validation"):
        raise ValueError(
            f"{where} holds the splits train and validation: load {where}/train or "
            f"{where}/validation (the root holds both: the held-out records would leak)"
        )


def domain_of_finished(folder: Path, levels: int = 3) -> bool:
    """A domain folder of a finished dataset (its manifest.json is the dataset's, a few
    folders up, and lists it): loadable on its own, though it holds no manifest."""
    folder = Path(folder).resolve()
    for parent in list(folder.parents)[:levels]:
        if (parent / "manifest.json").is_file():
            try:
                manifest = read_manifest(parent)
            except ValueError:
                return False
            domains = (manifest or {}).get("domains")
            return isinstance(domains, dict) and folder.relative_to(parent).as_posix() in domains
    return False


def run_output(folder: Path, shard: str | None) -> str | None:
    """What shows a folder without manifest.json to be a preprocessing run's output (None:
    nothing, a folder of shards written otherwise, as the seed's tools write them): its run
    folder, its rejects.jsonl, or a shard `shard` named as a run's tasks name theirs
    (`shard_TTTTT_III`). A shards.index alone proves nothing: `tokenmill index` indexes any
    folder of shards. Stats only, no listing."""
    folder = Path(folder)
    if (folder / RUN_DIR).is_dir():
        return f"{RUN_DIR}/ is there"
    if (folder / "rejects.jsonl").is_file():
        return "it holds the rejects.jsonl a preprocessing run writes"
    if shard is not None and run_shard(shard):
        return f"its shard {shard} is named as a preprocessing run's tasks name theirs"
    return None


def run_shard(rel: str) -> bool:
    """A shard (or part) named as a preprocessing run's tasks name theirs: `shard_TTTTT_III`."""
    return re.fullmatch(r"shard_\d{5}_\d{3,}|part_\d{5}_\d{3,}\.jsonl", Path(rel).name) is not None


def local_not_ours(folder: Path) -> str | None:
    """`not_ours` for a local folder."""
    manifest, run_id = Path(folder) / "manifest.json", Path(folder) / RUN_DIR / "run_id"
    return not_ours(
        manifest.read_bytes() if manifest.is_file() else None,
        run_id.read_bytes() if run_id.is_file() else None,
    )
