"""The house's rules, checked on the source: which room may import which, rooms inside a
room never import each other both ways, every room lists its modules, no cycle, no private
name across modules, and neither the shard format, object storage nor preprocessing imports
torch.

Layers, bottom up: shards/ (the format) -> storage/ (object storage) -> preprocess/ |
training/ -> dataflow/ -> tools/. training/ reaches preprocess/ only through the raw-JSONL
route; dataflow/ uses only preprocess/packing.py (the one best-fit packer) and knows nothing
of object storage.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "tokenmill"
# folder -> the tokenmill folders it may import from (besides itself and the package root)
ALLOWED = {
    "shards": set(),
    "storage": {"shards"},
    "preprocess": {"shards", "storage"},
    "training": {"shards", "storage", "preprocess"},
    "dataflow": {"shards", "training", "preprocess"},
    "tools": {"shards", "storage", "preprocess", "training", "dataflow"},
}
# the only modules through which a folder may reach a sibling it otherwise must not
NARROW = {
    ("training", "preprocess"): {
        "tokenmill.training.jsonl_store",
        "tokenmill.training.dataset_factory",
    },
    ("dataflow", "preprocess"): {"tokenmill.dataflow.batchers"},
}
NARROW_TARGETS = {("dataflow", "preprocess"): {"tokenmill.preprocess.packing"}}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, top_level_only: bool = False) -> list[tuple[str, list[str]]]:
    """(imported tokenmill module, names) for every import in the file (or only module-level)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tokenmill"):
            out.append((node.module or "", [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("tokenmill")]
    return out


def folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else None


def test_every_module_lives_in_a_folder_of_the_flow():
    loose = [m for m in modules() if m.count(".") == 1 and folder(m) is None]
    assert sorted(loose) == ["tokenmill.__main__"], loose


def check_no_cycle(graph: dict[str, set[str]], what: str) -> None:
    """Raises `what` with the path of the first cycle in `graph` (node -> nodes it imports)."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError(f"{what}: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def unit(module: str) -> str | None:
    """A module's place inside its room: the inner room it lies in, or itself for a module of
    the room's own (tokenmill.preprocess.chat.spans -> preprocess.chat; .config -> itself)."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] not in ALLOWED:
        return None
    return ".".join(parts[1:3])


def test_rooms_inside_a_room_import_one_way():
    """Inside a room, its inner rooms and own modules form no cycle (imports at module level;
    one inside a function reaches an optional engine only when asked)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules().items():
        here = unit(module)
        if here is None:
            continue
        for target, _ in imports(path, top_level_only=True):
            there = unit(target)
            if there and there != here and there.split(".")[0] == here.split(".")[0]:
                graph.setdefault(here, set()).add(there)
    check_no_cycle(graph, "rooms import both ways")


def test_every_room_lists_its_modules():
    """A room's __init__ docstring names each of its modules and inner rooms (in flow order)."""
    unlisted = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        room = init.parent
        if room == PACKAGE or room.parent == PACKAGE and room.name == "tools":
            continue
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = [p.stem for p in room.glob("*.py") if p.stem != "__init__"]
        names += [d.name + "/" for d in room.iterdir() if (d / "__init__.py").is_file()]
        for name in names:
            if not re.search(rf"(?<![\w/]){re.escape(name)}(?![\w])", text):
                unlisted.append(f"{room.relative_to(ROOT)}: {name}")
    assert not unlisted, "\n".join(unlisted)


def test_imports_run_only_downward():
    upward = []
    for module, path in modules().items():
        here = folder(module)
        if here is None:
            continue
        for target, _ in imports(path):
            there = folder(target)
            if there is None or there == here:
                continue
            if there not in ALLOWED[here]:
                upward.append(f"{module} -> {target}")
            elif (here, there) in NARROW and (
                module not in NARROW[(here, there)]
                or target not in NARROW_TARGETS.get((here, there), {target})
            ):
                upward.append(f"{module} -> {target} (only {sorted(NARROW[(here, there)])})")
    assert not upward, "\n".join(upward)


def test_no_private_name_crosses_a_module():
    crossing = [
        f"{module} imports {target}.{name}"
        for module, path in modules().items()
        for target, names in imports(path)
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert not crossing, "\n".join(crossing)


def test_no_import_cycle_at_module_level():
    graph = {
        module: {t for t, _ in imports(path, top_level_only=True) if t in modules() and t != module}
        for module, path in modules().items()
    }
    graph = {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}
    check_no_cycle(graph, "import cycle")


def test_the_format_and_preprocessing_never_import_torch():
    names = [
        m for m in modules() if folder(m) in ("shards", "storage", "preprocess") or m == "tokenmill"
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_only_storage_asks_where_a_path_lives():
    """Whether a path is a URL is asked in storage/ alone (its shard source, its locations):
    no other module spells `://` or calls `is_url`."""
    asking = []
    for module, path in modules().items():
        if folder(module) == "storage":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value == "://":
                asking.append(f"{module}:{node.lineno}: '://'")
            elif isinstance(node, (ast.Name, ast.alias)) and "is_url" in (
                getattr(node, "id", None),
                getattr(node, "name", None),
            ):
                asking.append(f"{module}:{node.lineno}: is_url")
    assert not asking, "\n".join(asking)
