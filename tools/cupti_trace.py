"""GPU activity of a process from NVIDIA's CUPTI, read through ctypes: what the device ran and when.

The GPU machine has no profiler (neither ``nsys`` nor ``ncu`` travel there), but CUPTI's activity API is
one shared library (``libcupti.so.13``, 4 MB, from the CUDA 13 toolkit or the ``nvidia-cuda-cupti``
wheel) that needs no privileges: it records every kernel the device runs (graph nodes included) with
its start and end on the device's clock, and every runtime/driver API call on the host's. This module
turns those records into plain tuples; ``tools/trace_step.py`` reads decode steps with it.

    tracer = Tracer()                # loads CUPTI, enables kernel, memcpy, memset (and API) records
    t0 = tracer.now()
    ...GPU work...
    mx.synchronize(); tracer.flush()
    kernels = tracer.take()          # [Activity(kind, name, start_ns, end_ns, ...)], ordered by start

Record layouts are those of CUPTI 13.0 (``CUpti_ActivityKernel10``, ``CUpti_ActivityMemcpy6``,
``CUpti_ActivityMemset4``, ``CUpti_ActivityAPI``): offsets measured with ``offsetof`` against
``cupti_activity.h`` 13.0.85: the library that travels must be that version (``Tracer.version`` holds the API
version it loaded, 130001 for 13.0; ``tests/test_cupti_trace.py`` reads synthetic records at these offsets).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path

KIND_MEMCPY, KIND_MEMSET, KIND_DRIVER, KIND_RUNTIME, KIND_KERNEL = 1, 2, 4, 5, 10
DOMAIN_DRIVER, DOMAIN_RUNTIME = 1, 2
CUPTI_SUCCESS = 0

# offsetof(...) in cupti_activity.h 13.0.85
_KERNEL = {"start": 16, "end": 24, "grid": 52, "block": 64, "name": 104, "registers": 6}
_COPY = {"start": 16, "end": 24, "bytes": 8}
_API = {"cbid": 4, "start": 8, "end": 16}

BUFFER_BYTES = 32 << 20  # large: a buffer that fills mid-step is parsed (in Python) while the step runs


class CuptiError(RuntimeError):
    pass


@dataclass(frozen=True)
class Activity:
    kind: str        # "kernel", "memcpy", "memset", "runtime", "driver"
    name: str        # kernel name (mangled as the module has it) or API function
    start: int       # ns, CUPTI's clock (cuptiGetTimestamp)
    end: int
    grid: tuple = ()
    block: tuple = ()
    registers: int = 0
    nbytes: int = 0

    @property
    def us(self) -> float:
        return (self.end - self.start) / 1e3


def _find_library() -> str:
    env = os.environ.get("RVQSTORE_CUPTI")
    candidates = [env] if env else []
    root = Path(__file__).resolve().parents[1]
    candidates += [str(root / ".gpu" / "e" / "libcupti.so.13"), "/usr/local/cuda-13.0/lib/libcupti.so.13",
                   "libcupti.so.13", "libcupti.so"]
    for c in candidates:
        if c and (os.path.sep not in c or os.path.exists(c)):
            try:
                ctypes.CDLL(c)
                return c
            except OSError:
                continue
    raise CuptiError("libcupti.so.13 not found (set RVQSTORE_CUPTI or put it in .gpu/e/)")


_REQUEST = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.POINTER(ctypes.c_uint8)), ctypes.POINTER(ctypes.c_size_t),
                            ctypes.POINTER(ctypes.c_size_t))
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint8), ctypes.c_size_t,
                             ctypes.c_size_t)


class Tracer:
    """One per process (CUPTI's callbacks are process-wide)."""

    def __init__(self, api: bool = True):
        self.lib = ctypes.CDLL(_find_library())
        self._lock = threading.Lock()
        self._buffers: dict[int, ctypes.Array] = {}
        self._records: list[Activity] = []
        self._api_names: dict[tuple[int, int], str] = {}
        version = ctypes.c_uint32()
        self._check(self.lib.cuptiGetVersion(ctypes.byref(version)), "cuptiGetVersion")
        self.version = version.value
        self._request = _REQUEST(self._on_request)  # kept alive: CUPTI calls them from its own thread
        self._complete = _COMPLETE(self._on_complete)
        self._check(self.lib.cuptiActivityRegisterCallbacks(self._request, self._complete),
                    "cuptiActivityRegisterCallbacks")
        self.kinds = []
        for k in (KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET):
            self._check(self.lib.cuptiActivityEnable(ctypes.c_int(k)), f"cuptiActivityEnable({k})")
            self.kinds.append(k)
        self.refused = {}
        for k in ((KIND_RUNTIME, KIND_DRIVER) if api else ()):
            rc = self.lib.cuptiActivityEnable(ctypes.c_int(k))  # API records are optional: some setups refuse one
            if rc == CUPTI_SUCCESS:
                self.kinds.append(k)
            else:
                self.refused[k] = rc
        atexit.register(self.close)  # CUPTI flushes at exit otherwise, into callbacks Python has torn down

    @staticmethod
    def _check(rc, what):
        if rc != CUPTI_SUCCESS:
            raise CuptiError(f"{what} returned CUPTI error {rc}")

    def now(self) -> int:
        t = ctypes.c_uint64()
        self.lib.cuptiGetTimestamp(ctypes.byref(t))
        return t.value

    def flush(self) -> None:
        self._check(self.lib.cuptiActivityFlushAll(ctypes.c_uint32(1)), "cuptiActivityFlushAll")

    def take(self) -> list[Activity]:
        """Every record completed since the last take, ordered by start."""
        with self._lock:
            out, self._records = self._records, []
        return sorted(out, key=lambda a: a.start)

    def close(self) -> None:
        if not self.kinds:
            return
        for k in self.kinds:
            self.lib.cuptiActivityDisable(ctypes.c_int(k))
        self.kinds = []
        self.flush()

    # CUPTI's callbacks -------------------------------------------------------------------------
    def _on_request(self, buf_ptr, size_ptr, max_records_ptr):
        buf = (ctypes.c_uint8 * (BUFFER_BYTES + 8))()
        addr = ctypes.addressof(buf)
        aligned = (addr + 7) & ~7
        with self._lock:
            self._buffers[aligned] = buf
        buf_ptr[0] = ctypes.cast(aligned, ctypes.POINTER(ctypes.c_uint8))
        size_ptr[0] = BUFFER_BYTES
        max_records_ptr[0] = 0

    def _on_complete(self, ctx, stream, buffer, size, valid):
        addr = ctypes.cast(buffer, ctypes.c_void_p).value
        out = []
        record = ctypes.POINTER(ctypes.c_uint8)()
        while valid and self.lib.cuptiActivityGetNextRecord(buffer, ctypes.c_size_t(valid),
                                                          ctypes.byref(record)) == CUPTI_SUCCESS:
            out.append(self._parse(ctypes.cast(record, ctypes.c_void_p).value))
        with self._lock:
            self._records.extend(a for a in out if a is not None)
            self._buffers.pop(addr, None)

    def _api_name(self, domain, cbid):
        key = (domain, cbid)
        if key not in self._api_names:
            name = ctypes.c_char_p()
            rc = self.lib.cuptiGetCallbackName(ctypes.c_int(domain), ctypes.c_uint32(cbid), ctypes.byref(name))
            self._api_names[key] = name.value.decode() if rc == CUPTI_SUCCESS and name.value else f"cbid{cbid}"
        return self._api_names[key]

    def _parse(self, p):
        u32 = lambda off: ctypes.c_uint32.from_address(p + off).value  # noqa: E731
        u64 = lambda off: ctypes.c_uint64.from_address(p + off).value  # noqa: E731
        kind = u32(0)
        if kind == KIND_KERNEL:
            name_ptr = ctypes.c_char_p.from_address(p + _KERNEL["name"]).value
            g, b = _KERNEL["grid"], _KERNEL["block"]
            return Activity("kernel", (name_ptr or b"?").decode(errors="replace"), u64(_KERNEL["start"]),
                            u64(_KERNEL["end"]), (ctypes.c_int32.from_address(p + g).value,
                                                  ctypes.c_int32.from_address(p + g + 4).value,
                                                  ctypes.c_int32.from_address(p + g + 8).value),
                            (ctypes.c_int32.from_address(p + b).value, ctypes.c_int32.from_address(p + b + 4).value,
                             ctypes.c_int32.from_address(p + b + 8).value),
                            ctypes.c_uint16.from_address(p + _KERNEL["registers"]).value)
        if kind in (KIND_MEMCPY, KIND_MEMSET):
            return Activity("memcpy" if kind == KIND_MEMCPY else "memset", "", u64(_COPY["start"]), u64(_COPY["end"]),
                            nbytes=u64(_COPY["bytes"]))
        if kind in (KIND_RUNTIME, KIND_DRIVER):
            domain = DOMAIN_RUNTIME if kind == KIND_RUNTIME else DOMAIN_DRIVER
            return Activity("runtime" if kind == KIND_RUNTIME else "driver", self._api_name(domain, u32(_API["cbid"])),
                            u64(_API["start"]), u64(_API["end"]))
        return None


def busy_ns(intervals) -> int:
    """Length of the union of [start, end) intervals (the device's busy time: kernels may overlap)."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
