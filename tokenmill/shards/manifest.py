"""TODO docstring"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenmill.shards.files import fsync_dir, tmp_path, write_durable
from tokenmill.shards.format import FORMAT_VERSION


def write_manifest(root: Path, manifest: dict) -> None:
    """Writes manifest.json atomically (temp + os.replace): its presence means the dataset is complete."""
    domains = manifest.get("domains", {})
    if not isinstance(domains, dict) or not all(isinstance(v, list) for v in domains.values()):
        raise ValueError(
            "manifest 'domains' must map a domain folder ('' for the root) to a list of shard infos"
        )
    manifest = {"format_version": FORMAT_VERSION, **manifest}
    path = Path(root) / "manifest.json"
    tmp = tmp_path(path)
    write_durable(tmp, (json.dumps(manifest, indent=2) + "\n").encode())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
