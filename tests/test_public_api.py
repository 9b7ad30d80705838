"""The public surface of SYSTEM.md section 7: every name, its kind and its call shape, pinned.

The golden file `golden/public_api.json` is the contract; a dropped, renamed or re-shaped
name fails here. After an intended change, regenerate it with TOKENMILL_REGEN_GOLDEN=1.
"""

import inspect
import json
import os
import re
import subprocess
import sys

from helpers import GOLDEN

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
