from rvqstore.blas import blas_is_fast, fast_blas_path


def test_suite_runs_with_fast_blas_when_the_machine_has_it():
    # tests/conftest.py re-executes pytest with OpenBLAS preloaded; CI installs it
    if fast_blas_path() is not None:
        assert blas_is_fast()
    else:
        assert fast_blas_path() is None


def _cli_stderr(env_changes):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "RVQSTORE_BLAS", "RVQSTORE_NO_REEXEC")}
    env.update(env_changes, PYTHONPATH=str(root))
    r = subprocess.run([sys.executable, "-m", "rvqstore", "cache-prompt", "--model", "/nonexistent/model",
                        "--prompt", "hi", "-o", "/nonexistent/x.rvq"], capture_output=True, text=True, env=env,
                       cwd=root, timeout=120)
    assert r.returncode != 0 and "does not exist" in r.stderr
    return r.stderr


def test_cli_says_when_mlx_runs_on_the_slow_reference_blas(tmp_path):
    # no re-exec and nothing preloaded: what a fresh machine without OpenBLAS gets
    err = _cli_stderr({"RVQSTORE_NO_REEXEC": "1", "RVQSTORE_BLAS": str(tmp_path / "missing.so")})
    assert "reference BLAS" in err and "apt-get install libopenblas0-pthread" in err
    lib = fast_blas_path()
    if lib is not None:  # installed but not loaded: the advice names it
        err = _cli_stderr({"RVQSTORE_NO_REEXEC": "1"})
        assert "reference BLAS" in err and lib in err
        # the CLI's own re-exec picks it up: no warning; so does a library chosen with RVQSTORE_BLAS
        assert "reference BLAS" not in _cli_stderr({})
        assert "reference BLAS" not in _cli_stderr({"RVQSTORE_BLAS": lib})
