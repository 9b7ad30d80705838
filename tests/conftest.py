import ast
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))


def _marks_slow(node: ast.expr) -> bool:
    """`pytest.mark.slow`, alone or in a list or tuple of marks."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_marks_slow(element) for element in node.elts)
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _slow_module(path: Path) -> bool:
    """A test module whose module-level `pytestmark` marks every test in it slow."""
    try:
        tree = ast.parse(path.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False  # let pytest collect it and report the error
    return any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and _marks_slow(node.value)
        for node in tree.body
    )


def pytest_ignore_collect(collection_path: Path, config):
    """Under `-m "not slow"` (make test-fast), a module whose tests are all slow is not even
    imported: its imports (Lightning, Ray, S3 servers) cost seconds of collection for tests
    that would all be deselected. Any other marker expression collects it as usual."""
    if config.getoption("markexpr", "") != "not slow":
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if _slow_module(collection_path):
            return True
    return None


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster of two CPUs for one test module. Its workers import the tests'
    own modules (the cleaning hooks live in tests/preprocess/test_cleaning.py)."""
    import ray

    here = Path(__file__).parent
    path = os.pathsep.join([str(here / "preprocess"), str(here), os.environ.get("PYTHONPATH", "")])
    ray.init(
        address="local",  # a cluster of its own, never one another job started
        num_cpus=2,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()
