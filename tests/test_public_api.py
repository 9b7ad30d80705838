"""The public surface of SYSTEM.md section 7: every name, its kind and its call shape, pinned.

The golden file `golden/public_api.json` is the contract; a dropped, renamed or re-shaped
name fails here. After an intended change, regenerate it with TOKENMILL_REGEN_GOLDEN=1.
"""

import ast
import inspect
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import GOLDEN, ROOT

import tokenmill
import tokenmill.dataflow

GOLDEN_API = GOLDEN / "public_api.json"


def _signature(obj) -> str:
    """The call shape, with annotations named without the module they live in."""
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"
    return re.sub(r"\btokenmill(\.\w+)*\.(?=[A-Z])", "", text)


def _describe(obj) -> dict:
    """A name's kind and call shapes: a class's constructor and public methods, a function's signature."""
    if inspect.isclass(obj):
        methods = {
            name: _signature(member)
            for name, member in sorted(vars(obj).items())
            if not name.startswith("_") and callable(member)
        }
        for name, member in sorted(vars(obj).items()):
            if isinstance(member, (staticmethod, classmethod)) and not name.startswith("_"):
                methods[name] = _signature(getattr(obj, name))
        return {"kind": "class", "init": _signature(obj), "methods": methods}
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    return {"kind": type(obj).__name__}


def surface() -> dict:
    return {
        "tokenmill": {
            name: _describe(getattr(tokenmill, name)) for name in sorted(tokenmill.__all__)
        },
        "tokenmill.dataflow": {
            name: _describe(getattr(tokenmill.dataflow, name))
            for name in sorted(tokenmill.dataflow.__all__)
        },
    }


def test_public_surface_matches_golden():
    now = surface()
    if os.environ.get("TOKENMILL_REGEN_GOLDEN"):
        GOLDEN_API.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN_API.read_text())
    for module in golden:
        dropped = sorted(set(golden[module]) - set(now[module]))
        assert not dropped, f"{module} no longer exports {dropped}"
        for name, shape in golden[module].items():
            assert now[module][name] == shape, f"{module}.{name} changed shape"
    assert now == golden


def test_seed_names_are_all_exported():
    seed_names = """PipelineConfig Pipeline detect_format StoreFactory MmapStore JsonlStore
        DatasetFactory SEQDataset SFTDataset DPODataset GRPODataset RDSampler DataDistributor
        RawItemProcessor SampleBatcher BatchCollator IterableDistributor MapDistributor
        RankPartitionedDistributor MixtureDistributor SimpleBatcher PoolPackingBatcher
        SequentialPackingBatcher DefaultBatchCollator DataflowLoader""".split()
    assert set(seed_names) <= set(tokenmill.__all__)
    for name in tokenmill.__all__:
        assert getattr(tokenmill, name) is not None, name


def test_import_is_light():
    code = "import sys, tokenmill; tokenmill.Pipeline; tokenmill.PipelineConfig; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _root_names() -> tuple[dict[str, str], dict[str, str]]:
    """tokenmill/__init__.py read as text: `_EXPORTS` (name -> module), and the names its
    `if TYPE_CHECKING:` block imports (name -> module), each imported `as` itself."""
    tree = ast.parse((ROOT / "tokenmill" / "__init__.py").read_text())
    exports: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            exports = ast.literal_eval(node.value)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in ast.walk(node):
                if isinstance(statement, ast.ImportFrom):
                    for alias in statement.names:
                        assert alias.asname == alias.name, f"{alias.name}: import it as itself"
                        assert alias.name not in typed, f"{alias.name} imported twice"
                        typed[alias.name] = statement.module or ""
    return exports, typed


def test_type_checkers_are_shown_every_export_from_its_module():
    """The TYPE_CHECKING imports and the lazy `_EXPORTS` name the same names from the same
    modules, so what a type checker sees is what `tokenmill.X` returns."""
    exports, typed = _root_names()
    assert exports, "no _EXPORTS in tokenmill/__init__.py"
    assert typed == exports


@pytest.mark.slow  # a cold mypy run that follows torch (~15 s)
def test_a_users_type_checker_sees_the_real_types_of_the_root_exports(tmp_path):
    """mypy, with the repository's config, on a user's file: `tokenmill.Pipeline` is a class
    (not Any), so assigning it to an int is an error, and MmapStore's constructor is shown."""
    user = tmp_path / "user.py"
    user.write_text(
        "import tokenmill\n\nx: int = tokenmill.Pipeline\nreveal_type(tokenmill.MmapStore)\n"
    )
    command = [
        sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
        "--follow-imports=silent", "--cache-dir", str(tmp_path / "mypy_cache"), str(user),
    ]  # fmt: skip
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said
    wrong = (
        'user.py:3: error: Incompatible types in assignment (expression has type "type[Pipeline]"'
    )
    assert wrong in said
    assert re.search(
        r'user.py:4: note: Revealed type is "def \(.*\) -> tokenmill\.[\w.]+\.MmapStore"', said
    ), said
