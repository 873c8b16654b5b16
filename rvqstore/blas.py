"""Fast BLAS for the Linux CPU backend.

The Linux ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS, which makes float32 matmuls
~20x slower than OpenBLAS. Debian's ``libopenblas0-pthread`` provides a drop-in ``libblas.so.3``;
preloading it (``LD_PRELOAD``) makes MLX's BLAS calls resolve to OpenBLAS. The preload has to
happen before the process starts, hence the re-exec helper for CLI entry points.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

__all__ = ["fast_blas_path", "blas_is_fast", "maybe_reexec_with_openblas", "slow_blas_advice"]

# Where distributions put an OpenBLAS that exports the plain CBLAS symbols MLX calls: Debian/Ubuntu's
# libblas.so.3 alternatives (pthread, openmp) and libopenblas.so.0, Fedora/RHEL's, Arch's.
_CANDIDATES = tuple(
    f"/usr/lib/{arch}-linux-gnu/{name}" for name in (
        "openblas-pthread/libblas.so.3", "openblas-openmp/libblas.so.3", "libopenblas.so.0")
    for arch in ("x86_64", "aarch64")
) + ("/usr/lib64/libopenblas.so.0", "/usr/lib64/libopenblasp.so.0", "/usr/lib/libopenblas.so.0")
NO_REEXEC_ENV = "RVQSTORE_NO_REEXEC"
#: A BLAS library of the user's choice (any that exports ``cblas_sgemm``: OpenBLAS, BLIS, MKL's
#: ``libmkl_rt.so``), preloaded instead of the locations above.
BLAS_ENV = "RVQSTORE_BLAS"
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread (Debian/Ubuntu; dnf install openblas on Fedora)"


def fast_blas_path() -> str | None:
    """Path of an installed OpenBLAS MLX can use (``$RVQSTORE_BLAS`` first), Linux only, else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    chosen = os.environ.get(BLAS_ENV)
    if chosen:
        return chosen if os.path.isfile(chosen) else None
    return next((p for p in _CANDIDATES if os.path.isfile(p)), None)


def slow_blas_advice() -> str | None:
    """What to tell a user whose process runs MLX on the wheel's reference BLAS, or None if fine.

    Measured on a 2-core x86 VM (tools/results/blas-cpu.md): float32 matmuls ~20-40x slower with the
    reference BLAS; the bundled model's prefill ~25x slower.
    """
    if not sys.platform.startswith("linux") or blas_is_fast():
        return None
    try:
        import mlx.core as mx

        if mx.default_device().type != mx.DeviceType.cpu:
            return None  # a GPU does the matmuls
    except Exception:  # noqa: BLE001 - advice only
        pass
    lib = fast_blas_path()
    head = ("MLX is running on the reference BLAS bundled with the mlx[cpu] wheel: float32 matmuls (model "
            "prefill) are ~25x slower than with OpenBLAS.")
    if lib is None:
        return (f"{head} Install OpenBLAS: {INSTALL_HINT}; the rvqstore command then uses it automatically "
                f"(or point {BLAS_ENV} at any libopenblas.so / libblas.so.3 that exports cblas_sgemm).")
    return (f"{head} OpenBLAS is installed at {lib} but not loaded: start Python with LD_PRELOAD={lib}, or call "
            f"rvqstore.blas.maybe_reexec_with_openblas() first thing (unset {NO_REEXEC_ENV} for the CLI).")


def blas_is_fast() -> bool:
    """Whether this process has a fast BLAS: OpenBLAS mapped (per ``/proc/self/maps``) on Linux;
    always True on macOS, where MLX uses Accelerate (and Metal)."""
    if sys.platform == "darwin":
        return True
    chosen = os.path.realpath(os.environ[BLAS_ENV]) if os.environ.get(BLAS_ENV) else None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            mapped = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return False
    if chosen is not None and chosen in mapped:
        return True
    paths = {p for p in mapped if "libopenblas" in p}
    # Wheel-vendored copies (numpy.libs/libopenblas64_p-...so) use suffixed symbols MLX never
    # calls, so they do not count.
    return any(".libs/" not in p for p in paths)


def maybe_reexec_with_openblas(argv: Sequence[str] | None = None) -> None:
    """Re-exec this interpreter with OpenBLAS preloaded, if that would help; else return.

    Call it first thing in a CLI entry point. It does nothing unless: on Linux, OpenBLAS is
    installed but not loaded, ``RVQSTORE_NO_REEXEC`` is unset, and the process is not an
    interactive session. The child gets ``LD_PRELOAD`` (prepended to any existing value) and
    ``RVQSTORE_NO_REEXEC=1`` so it never loops.

    Args:
        argv: interpreter arguments to run again (what follows ``python``). Defaults to
            ``sys.orig_argv[1:]``, which keeps ``-m package`` and ``-c`` invocations intact.
    """
    if os.environ.get(NO_REEXEC_ENV) or sys.flags.interactive or hasattr(sys, "ps1"):
        return
    lib = fast_blas_path()
    if lib is None or blas_is_fast():
        return
    args = list(sys.orig_argv[1:] if argv is None else argv)
    if not args:  # a bare `python` would restart as a REPL
        return
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    if lib in preload.split(":"):  # preloaded yet not mapped: re-exec cannot help
        return
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    env[NO_REEXEC_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *args], env)
