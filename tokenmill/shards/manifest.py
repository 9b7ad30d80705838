"""manifest.json: the dataset's table of contents, written last, so its presence means complete."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.shards.files import write_atomic
from tokenmill.shards.format import FORMAT_VERSION


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
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{where}: format_version {manifest['format_version']} is newer than this "
            f"tokenmill reads ({FORMAT_VERSION}); upgrade tokenmill"
        )
    return manifest
