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
    path = Path(root) / "manifest.json"
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path}: format_version {manifest['format_version']} is newer than this "
            f"tokenmill reads ({FORMAT_VERSION}); upgrade tokenmill"
        )
    return manifest
