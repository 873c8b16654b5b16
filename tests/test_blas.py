from rvqstore.blas import blas_is_fast, fast_blas_path
from subprocess_env import python_path


def test_suite_runs_with_fast_blas_when_the_machine_has_it():
    # tests/conftest.py re-executes pytest with OpenBLAS preloaded; CI installs it
    if fast_blas_path() is not None:
        assert blas_is_fast()
    else:
        assert fast_blas_path() is None



def test_slow_blas_advice(monkeypatch, tmp_path):
    import mlx.core as mx

    import rvqstore.blas as blas

    # the advice concerns MLX's CPU backend: on a GPU machine, ask it about the CPU device
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.DeviceType.cpu))

    lib = fast_blas_path()
    if lib is not None:  # this process runs with it preloaded (conftest): found mapped under its own name too
        monkeypatch.setenv(blas.BLAS_ENV, lib)
        assert blas.blas_is_fast() and blas.slow_blas_advice() is None
    monkeypatch.setattr(blas, "blas_is_fast", lambda: False)
    monkeypatch.setenv(blas.BLAS_ENV, str(tmp_path / "missing.so"))
    advice = blas.slow_blas_advice()
    assert "reference BLAS" in advice and "apt-get install libopenblas0-pthread" in advice
    monkeypatch.delenv(blas.BLAS_ENV)
    if lib is not None:  # installed but not loaded: the advice says how to preload it
        assert f"LD_PRELOAD={lib}" in blas.slow_blas_advice()


def test_cli_warns_on_a_machine_without_openblas(tmp_path):
    """A fresh machine: nothing preloaded, no OpenBLAS found; the CLI says why it will be slow and what to do."""
    import mlx.core as mx
    import pytest

    if mx.default_device().type != mx.DeviceType.cpu:
        pytest.skip("the warning concerns MLX's CPU backend; here a GPU does the matmuls")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RVQSTORE_NO_REEXEC")}
    env.update(RVQSTORE_BLAS=str(tmp_path / "missing.so"), PYTHONPATH=python_path(root))
    r = subprocess.run([sys.executable, "-m", "rvqstore", "cache-prompt", "--model", "/nonexistent/model",
                        "--prompt", "hi", "-o", str(tmp_path / "x.rvq")], capture_output=True, text=True, env=env,
                       cwd=root, timeout=120)
    assert r.returncode != 0 and "does not exist" in r.stderr
    assert "warning: MLX is running on the reference BLAS" in r.stderr and "libopenblas0-pthread" in r.stderr
