"""Keep glibc from returning freed heap pages to the OS between decode steps (CUDA path, Linux/glibc only).

MLX copies a precompiled kernel's binary (7-47 KB for rvqstore's kernels) into every graph node it builds,
twice (nanobind's bytes to a string, then into the node). A decode step builds a few such nodes per layer, so
a step allocates megabytes of mid-size blocks that glibc takes from the top of its heap and, once the step's
graph is freed, trims back to the OS; the next step then page-faults all of it in again. On the H200 that made
a node's build cost grow by ~0.6 us per KB of binary (``tools/bench_launch_overhead.py``,
``tools/results/launch-overhead-h200.json``), ~1 ms of a 32-layer step. Raising glibc's trim threshold (and
padding the heap's growth) keeps those pages mapped for reuse.

Launches by reference (:mod:`rvqstore.kernel_ref`, the default) copy ~90 bytes instead, so :func:`tune` is
called only where a configuration launches with its binary (a first launch by reference that failed, or
references off), once per process; it changes the
process's allocator (freed heap memory up to ``TRIM_THRESHOLD`` bytes stays with the process), so it is
switchable: ``RVQSTORE_MALLOC_TUNE=0`` leaves glibc's settings alone. Elsewhere (no glibc, macOS, musl) it
does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading

log = logging.getLogger("rvqstore.kernels")

ENV = "RVQSTORE_MALLOC_TUNE"
#: glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
#: freed memory at the top of the heap kept up to this size instead of trimmed
TRIM_THRESHOLD = 256 << 20
#: extra bytes asked from the OS whenever the heap grows
TOP_PAD = 16 << 20

_lock = threading.Lock()
_state: dict = {}  # "done": bool, "applied": bool


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0"


def tune() -> bool:
    """Apply the settings once per process; True if they are in effect."""
    if "done" in _state:
        return _state["applied"]
    with _lock:
        if "done" not in _state:
            _state["applied"] = _apply() if enabled() else False
            _state["done"] = True
    return _state["applied"]


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        version = libc.gnu_get_libc_version  # glibc only (musl has no mallopt parameters of these numbers)
    except (OSError, AttributeError):
        return False
    version.restype = ctypes.c_char_p
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and mallopt(M_TOP_PAD, TOP_PAD) == 1
    log.info("glibc %s: malloc trim threshold %d MB, top pad %d MB (%s=0 leaves them)%s",
             version().decode(), TRIM_THRESHOLD >> 20, TOP_PAD >> 20, ENV, "" if ok else ": refused")
    return ok
