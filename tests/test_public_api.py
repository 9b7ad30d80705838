"""The public surface of SYSTEM.md section 7 resolves, and importing tokenmill does not import torch."""

import subprocess
import sys

import tokenmill


def test_every_public_name_resolves():
    for name in tokenmill.__all__:
        assert getattr(tokenmill, name) is not None, name


def test_import_is_light():
    code = "import sys, tokenmill; tokenmill.Pipeline; tokenmill.PipelineConfig; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
