"""Shared test setup: GPU marker skipping and the bundled-model fixture."""

from __future__ import annotations

import mlx.core as mx
import pytest


def gpu_backend_available() -> bool:
    try:
        if mx.metal.is_available():
            return True
    except Exception:
        pass
    try:
        return bool(mx.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_backend_available():
        return
    skip = pytest.mark.skip(reason="no GPU backend (Metal or CUDA) in this MLX build")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
