"""PYTHONPATH for the tests' subprocesses: the repository first, then whatever the parent had (on the
GPU machine the dependencies themselves come through PYTHONPATH, so replacing it loses MLX)."""

from __future__ import annotations

import os


def python_path(root) -> str:
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(root)] + ([inherited] if inherited else []))
