"""numpy's own BLAS kept to one thread while the host attention path (:mod:`.host`) runs.

numpy's Linux wheels bundle their own OpenBLAS (``scipy_openblas``), separate from the one MLX calls.
Its worker threads busy-wait for a while after each threaded call; on a 2-core machine they then take
the cores MLX's next matmuls need. Measured on SmolLM2 at 4k tokens (2+2): a packed decode step of
2.45 s with numpy's default 2 threads, 0.23 s with one. The host path's matrices are small (a few
query rows against one block of code rows), so one thread loses nothing there.

:func:`one_thread` sets numpy's OpenBLAS to one thread for the duration and restores the previous
count after. Where numpy uses another BLAS (Accelerate, MKL) or the library cannot be found, it does
nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import threading

_lock = threading.Lock()
_api: tuple | None = None  # (get, set) or () when not found
# symbol pairs of the OpenBLAS builds numpy has shipped (ILP64 scipy-openblas, older openblas64_, plain)
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))


def _find() -> tuple:
    import numpy

    libs = os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "*openblas*"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: the same handle
        except OSError:
            continue
        for get_name, set_name in _SYMBOLS:
            get, set_ = getattr(lib, get_name, None), getattr(lib, set_name, None)
            if get is not None and set_ is not None:
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                return (get, set_)
    return ()


def _functions() -> tuple:
    global _api
    if _api is None:
        with _lock:
            if _api is None:
                _api = _find()
    return _api


@contextlib.contextmanager
def one_thread():
    api = _functions()
    if not api:
        yield
        return
    get, set_ = api
    prev = get()
    if prev != 1:
        set_(1)
    try:
        yield
    finally:
        if prev != 1:
            set_(prev)
