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

__all__ = ["fast_blas_path", "blas_is_fast", "maybe_reexec_with_openblas"]

# Debian/Ubuntu multiarch locations of the OpenBLAS (pthread) libblas.so.3 alternative.
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
NO_REEXEC_ENV = "RVQSTORE_NO_REEXEC"


def fast_blas_path() -> str | None:
    """Path of Debian's OpenBLAS ``libblas.so.3`` if installed (Linux only), else ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in _CANDIDATES if os.path.isfile(p)), None)


def blas_is_fast() -> bool:
    """Whether this process has a fast BLAS: OpenBLAS mapped (per ``/proc/self/maps``) on Linux;
    always True on macOS, where MLX uses Accelerate (and Metal)."""
    if sys.platform == "darwin":
        return True
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "libopenblas" in line}
    except OSError:
        return False
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
