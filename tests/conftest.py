"""Shared test setup: GPU marker skipping and the bundled-model fixture."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import mlx.core as mx
import pytest

# rvqstore's per-machine caches (rvqstore.kernel_cache: compiled kernels and first-use verdicts;
# rvqstore.weights_cache: weight hashes): the suite keeps them in directories of its own, never the user's
# ~/.cache, so every run starts as a fresh machine does (subprocesses and the OpenBLAS re-execution below
# inherit them)
for _env, _prefix in (("RVQSTORE_KERNEL_CACHE", "rvqstore-test-kernels-"),
                      ("RVQSTORE_WEIGHTS_CACHE", "rvqstore-test-weights-")):
    if not os.path.basename(os.environ.get(_env, "")).startswith(_prefix):
        os.environ[_env] = tempfile.mkdtemp(prefix=_prefix)
    atexit.register(shutil.rmtree, os.environ[_env], True)


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



def pytest_configure(config):
    """Re-run the suite once with OpenBLAS preloaded when the machine has it but this process lacks
    it (the mlx[cpu] wheel's bundled BLAS makes float32 matmuls ~20x slower)."""
    from rvqstore.blas import blas_is_fast, fast_blas_path, maybe_reexec_with_openblas

    if fast_blas_path() and not blas_is_fast():
        capman = config.pluginmanager.getplugin("capturemanager")
        if capman is not None:  # give the terminal back to the process that replaces this one
            capman.stop_global_capturing()
        maybe_reexec_with_openblas()


@pytest.fixture(scope="session")
def smollm2():
    """The bundled SmolLM2-135M-Instruct (model, tokenizer). Missing model: skip locally, fail in CI
    (CI installs it, so a skip there would hide the real-model tests)."""
    import os

    from rvqstore.errors import ModelNotFoundError
    from rvqstore.model import load_model

    try:
        return load_model()
    except ModelNotFoundError as e:
        if os.environ.get("CI"):
            pytest.fail(f"bundled model missing in CI: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def sample_tokens(smollm2):
    """Token ids of the bundled real English text."""
    from importlib import resources

    text = resources.files("rvqstore").joinpath("data/python_docs_excerpt.txt").read_text(encoding="utf-8")
    return list(smollm2[1].encode(text))
