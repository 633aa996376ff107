"""OpenCLIP's whole package (its factory, transforms and tokenizer) in a virtual environment of
its own, used through a subprocess.

open_clip's factory imports torchvision, and the torchvision the registry serves is a CUDA build
that cannot be imported beside the project's torch CPU build. `make test` therefore creates
`.venv-ref` with a matching torch/torchvision pair and open_clip_torch (see the Makefile); the
reference tests run their OpenCLIP side there. Without it they skip, saying how to create it, or
fail when the environment variable CI is set: in CI a missing reference is an error.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def reference_python() -> Path:
    """The reference interpreter: $BIGCLIP_REFERENCE_PYTHON, else REPO/.venv-ref/bin/python."""
    path = Path(os.environ.get("BIGCLIP_REFERENCE_PYTHON") or REPO / ".venv-ref" / "bin" / "python")
    probe = [str(path), "-c", "import open_clip, torchvision"]
    ok = path.is_file() and subprocess.run(probe, capture_output=True, timeout=300).returncode == 0
    if not ok:
        message = (
            f"OpenCLIP reference environment {path} is missing or cannot import open_clip and torchvision; "
            "`make test` creates .venv-ref (torch + torchvision + open_clip_torch)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_reference(script: str, *args: str, timeout: int = 600) -> str:
    """Run `script` (Python source) in the reference environment; its stdout, or fail with stderr."""
    proc = subprocess.run(
        [str(reference_python()), "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, f"reference script failed:\n{proc.stderr[-4000:]}"
    return proc.stdout
