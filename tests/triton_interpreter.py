"""Running a test file's Triton kernels on CPU: Triton's interpreter (TRITON_INTERPRET=1) must be set before
Triton is imported, so the file runs again in a subprocess, where its __main__ calls its check_kernels()."""

import os
import sys
import subprocess
import importlib.metadata
import importlib.util

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (pip install triton)")


def _triton_version():
    return tuple(int(v) for v in importlib.metadata.version("triton").split(".")[:2])


# Triton 3.6's interpreter (the version beside torch 2.11 on GPU hosts) fails on some of our kernels where 3.7+ runs them:
# persistent kernels (relu_square_mm.py: a loop that starts at tl.program_id) and the loss kernel (softcap_ce.py:
# "only 0-dimensional arrays can be converted to Python scalars" inside the interpreter, seen 2026-11-23)
needs_interpreter_37 = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or _triton_version() < (3, 7),
    reason="needs Triton 3.7+: 3.6's interpreter fails on this kernel (seen with Triton 3.6)")


def run_under_interpreter(test_file):
    """Run test_file under the interpreter; it must exit 0 and print 'kernels ok'."""
    # the repository on the path too, for a checkout that is not pip-installed
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, test_file], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0 and "kernels ok" in result.stdout, result.stdout + result.stderr
