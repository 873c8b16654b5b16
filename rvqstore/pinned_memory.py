"""Page-locked host memory the GPU reads directly (CUDA driver API through ctypes).

A buffer from :func:`allocate` is ordinary cacheable host memory, locked and mapped into the device's
address space (``cuMemHostAlloc`` with ``PORTABLE | DEVICEMAP``): the CPU writes it at memory speed (its
pages were faulted in and locked once, at allocation) and a kernel reads it over the host link by its
device address. :mod:`rvqstore.device_upload` stages a file's sections in such buffers. Only the driver
library (``libcuda.so.1``, present wherever the CUDA backend runs) is needed; calls run in the device's
primary context, the one MLX's runtime uses. Anything missing raises :class:`PinnedMemoryError`.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

#: cuMemHostAlloc flags (cuda.h)
CU_MEMHOSTALLOC_PORTABLE = 0x01
CU_MEMHOSTALLOC_DEVICEMAP = 0x02


class PinnedMemoryError(RuntimeError):
    """Page-locked memory is not available here (no driver, no device, or the allocation failed)."""


_lock = threading.Lock()
_driver: dict = {}  # "lib", "ctx"


def _fn(lib, *names):
    for n in names:
        f = getattr(lib, n, None)
        if f is not None:
            f.restype = ctypes.c_int
            return f
    raise PinnedMemoryError(f"the CUDA driver has none of {names}")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise PinnedMemoryError(f"{what} failed (CUresult {status})")


def _context(device: int = 0):
    """The driver library and the device's primary context (retained once per process)."""
    with _lock:
        if "ctx" not in _driver:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise PinnedMemoryError(f"no CUDA driver library ({e})") from None
            _check(_fn(lib, "cuInit")(0), "cuInit")
            dev = ctypes.c_int()
            _check(_fn(lib, "cuDeviceGet")(ctypes.byref(dev), device), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            _check(_fn(lib, "cuDevicePrimaryCtxRetain")(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            _driver.update(lib=lib, ctx=ctx)
        return _driver["lib"], _driver["ctx"]


class _Current:
    """The primary context made current in this thread for the duration of a driver call."""

    def __init__(self):
        self.lib, self.ctx = _context()

    def __enter__(self):
        _check(_fn(self.lib, "cuCtxPushCurrent_v2", "cuCtxPushCurrent")(self.ctx), "cuCtxPushCurrent")
        return self.lib

    def __exit__(self, *exc):
        old = ctypes.c_void_p()
        _fn(self.lib, "cuCtxPopCurrent_v2", "cuCtxPopCurrent")(ctypes.byref(old))


def _free(lib, ptr: int) -> None:
    f = _fn(lib, "cuMemFreeHost")
    f.argtypes = [ctypes.c_void_p]
    f(ptr)


class PinnedBuffer:
    """``nbytes`` of page-locked, device-mapped host memory: ``array`` (a writable uint8 numpy view),
    ``device_address`` (what a kernel reads). Freed by :meth:`free` (or when collected)."""

    def __init__(self, nbytes: int):
        if nbytes <= 0:
            raise ValueError(f"a pinned buffer needs a positive size, not {nbytes}")
        self.nbytes = int(nbytes)
        ptr = ctypes.c_void_p()
        dptr = ctypes.c_uint64()
        with _Current() as lib:
            alloc = _fn(lib, "cuMemHostAlloc")
            alloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
            _check(alloc(ctypes.byref(ptr), self.nbytes, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP),
                   f"cuMemHostAlloc of {self.nbytes} bytes")
            try:
                get = _fn(lib, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer")
                get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
                _check(get(ctypes.byref(dptr), ptr, 0), "cuMemHostGetDevicePointer")
            except BaseException:
                _free(lib, ptr.value)
                raise
        self._ptr = ptr.value
        self.device_address = dptr.value
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * self.nbytes).from_address(self._ptr))

    def free(self) -> None:
        if self._ptr:
            ptr, self._ptr = self._ptr, 0
            self.array = None
            with _Current() as lib:
                _free(lib, ptr)

    def __del__(self):  # pragma: no cover - best effort at collection
        try:
            self.free()
        except Exception:
            pass


def allocate(nbytes: int) -> PinnedBuffer:
    """A :class:`PinnedBuffer` of ``nbytes``; :class:`PinnedMemoryError` where there is none to have."""
    return PinnedBuffer(nbytes)
