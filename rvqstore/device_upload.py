"""A file's sections into device memory through a ring of pinned host memory (CUDA).

MLX's CUDA backend makes an array from host data (``mx.array`` of numpy, what the regular reader hands on) in
fresh CUDA managed memory: the copy into it page-faults every page on first touch, and the device copy that
:mod:`rvqstore.device_memory` starts faults them again towards the GPU. On the H200's host that ran at ~1.8 GB/s,
whatever the file's bytes had cost to read (``tools/results/profile-resume-h200-device-copies.json``). Here the
bytes take another road:

- one buffer of page-locked, device-mapped host memory (:mod:`rvqstore.pinned_memory`), kept by the process and
  used as a FIFO ring (:class:`StagingRing`); its pages were faulted in once, at allocation;
- worker threads (:data:`THREADS` for mostly compressed loads, :data:`RAW_THREADS` else) verify each section and
  write its decoded bytes straight into its slot of the ring (:meth:`RVQFile.read_section_into`: checksum, then a
  copy out of the file's mapping or a zstd decompression into the slot);
- in the caller's thread, one kernel (``kernels/rvq_upload.inc``) per run of neighbouring slots copies them over the
  host link into a new device array (MLX's allocation, an ordinary GPU operation's output), started at once; each
  section is a view of it;
- a slot is reused once the copy that read it has completed (the oldest copy is waited for when the ring is
  full).

The result is what :meth:`RVQFile.read_sections` ``(as_mx=True)`` gives, bit for bit, in device memory.
Sections the ring cannot take (empty, float64, larger than half the ring) and sources that do not allow
concurrent reads go the regular way. The kernel is checked at first use against the bytes it copied (kept per
machine, :mod:`rvqstore.first_use`); no driver, no pinned memory or a failed check switch the path off for the
process (logged once). ``RVQSTORE_PINNED_MB`` sets the ring's largest size in MiB (default
:data:`DEFAULT_MB`; ``0`` turns the path off); :func:`release` frees it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from . import device_memory, first_use, fused, kernel_cache, pinned_memory

log = logging.getLogger("rvqstore.kernels")

ENV = "RVQSTORE_PINNED_MB"
#: the ring's largest size (MiB) unless ``RVQSTORE_PINNED_MB`` says otherwise
DEFAULT_MB = 256
#: the smallest ring worth allocating, and the granularity slots are aligned to
MIN_RING = 16 << 20
ALIGN = 256
#: worker threads that verify and decompress sections into the ring, where most of a load's bytes are compressed:
#: zstd is CPU-bound, so every core up to 16 (H200 host, 32k tokens, `profile-resume-h200-threads-32k.json`: 2+2
#: `auto` sections 0.106 s on 16 against 0.168 on 8, 4+2 0.188 against 0.281)
THREADS = max(1, min(16, os.cpu_count() or 1))
#: ... and where most are stored raw: their copies are bound by memory bandwidth, which more threads only contend
#: for (same runs: 4+2 uncompressed 0.085 s on 8, 0.102 on 16)
RAW_THREADS = max(1, min(8, os.cpu_count() or 1))
#: sections submitted to the workers ahead of the one the caller waits for, per worker (bounds how far they run
#: ahead)
AHEAD_PER_THREAD = 2
#: a launch copies a run of neighbouring sections of the ring, up to this fraction (1 / GROUP_SHARE) of it: every
#: launch is an MLX evaluation of its own (on CUDA a graph built and started), which, one per section (192 in a
#: 32-layer file), cost more than the copies of a short context (docs/attention.md, "Sections through a pinned
#: ring"); 0 < share; a large share (many small launches) is the first version's one launch per section
GROUP_SHARE = 8

_MX = {np.dtype(d): m for d, m in (
    ("|u1", mx.uint8), ("|i1", mx.int8), ("<u2", mx.uint16), ("<i2", mx.int16), ("<u4", mx.uint32),
    ("<i4", mx.int32), ("<u8", mx.uint64), ("<i8", mx.int64), ("<f2", mx.float16), ("<f4", mx.float32))}


def _slot(n: int) -> int:
    """The ring bytes a section of ``n`` bytes takes (:meth:`StagingRing.take`)."""
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class StagingRing:
    """FIFO allocation of byte ranges in one buffer: :meth:`take` a range at the head (None when the free space
    cannot hold it now), :meth:`release` the oldest. Ranges are :data:`ALIGN`-aligned and contiguous."""

    def __init__(self, capacity: int):
        self.capacity = capacity - capacity % ALIGN
        self._live: deque = deque()  # (start, end), oldest first

    def __len__(self) -> int:
        return len(self._live)

    def take(self, n: int) -> int | None:
        size = _slot(n)
        if size > self.capacity:
            raise ValueError(f"{n} bytes do not fit a ring of {self.capacity}")
        if not self._live:
            start = 0
        else:
            first, (last_start, head) = self._live[0][0], self._live[-1]
            if last_start >= first:  # not wrapped: free are [head, capacity) and [0, first)
                start = head if self.capacity - head >= size else 0 if first >= size else None
            else:  # wrapped: free is [head, first)
                start = head if first - head >= size else None
        if start is not None:
            self._live.append((start, start + size))
        return start

    def release(self) -> None:
        self._live.popleft()


class _Ring:
    """The process's pinned buffer and its ring (grown on demand up to the configured size)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.buffer: pinned_memory.PinnedBuffer | None = None

    def ensure(self, want: int) -> pinned_memory.PinnedBuffer:
        if self.buffer is None or self.buffer.nbytes < want:
            if self.buffer is not None:
                self.buffer.free()
                self.buffer = None
            self.buffer = pinned_memory.allocate(want)
        return self.buffer


_ring = _Ring()
_state_lock = threading.Lock()
_disabled: dict = {}
_verified: set = set()
_kernel_fn: list = []


def max_bytes() -> int:
    try:
        mb = float(os.environ.get(ENV, DEFAULT_MB))
    except ValueError:
        mb = DEFAULT_MB
    return max(0, int(mb * (1 << 20)))


def release() -> None:
    """Free the process's pinned ring (a later load allocates it again)."""
    with _ring.lock:
        if _ring.buffer is not None:
            _ring.buffer.free()
            _ring.buffer = None


def _kernel():
    if not _kernel_fn:
        body = fused.load_source("rvq_upload.inc")
        _kernel_fn.append(kernel_cache.cuda_kernel(
            name="rvq_upload", input_names=["src"], output_names=["out"], source=body, ensure_row_contiguous=True))
    return _kernel_fn[0]


def _launch(address: int, n: int) -> mx.array:
    """A new device array of the ``n`` bytes at device ``address`` (pinned host memory)."""
    src = mx.array([address, n], dtype=mx.uint64)
    blocks = max(1, min(1024, -(-(n >> 4) // 256)))
    return _kernel()(inputs=[src], output_shapes=[(n,)], output_dtypes=[mx.uint8], grid=(blocks * 256, 1, 1),
                     threadgroup=(256, 1, 1))[0]


def _checked_copy(buffer: pinned_memory.PinnedBuffer) -> bool:
    """Whether the upload kernel copies bytes exactly here (first use, kept per machine)."""
    if "upload" in _verified:
        return True
    n = 4096 + 37  # the 16-byte loop, its tail of the four-load loop and the byte tail
    probe = np.frombuffer(np.random.default_rng(9).bytes(n), np.uint8)

    def launch():
        buffer.array[:n] = probe
        return _launch(buffer.device_address, n)

    def check(out):
        got = np.array(out)
        return None if np.array_equal(got, probe) else f"{int(np.count_nonzero(got != probe))} of {n} bytes differ"

    out = first_use.serve("upload", launch, check, verified=_verified, disabled=_disabled, lock=_state_lock,
                          what="pinned upload kernel")
    if out is not None:
        mx.eval(out)
    return out is not None


def available() -> bool:
    """Whether loads here go through the pinned ring (CUDA as the default device, a ring size above zero, not
    switched off in this process)."""
    return (fused.gpu_backend() == "cuda" and fused._on_gpu() and max_bytes() >= MIN_RING
            and "process" not in _disabled)


def _eligible(f, name: str, half: int) -> bool:
    s = f.section(name)
    return 0 < s.raw_length <= half and s.numpy_dtype in _MX


def workers(f, names: Sequence[str]) -> int:
    """How many worker threads a load of ``names`` takes: :data:`THREADS` where compressed sections hold at least
    half of its decoded bytes, else :data:`RAW_THREADS`."""
    total = sum(f.section(n).raw_length for n in names)
    packed = sum(f.section(n).raw_length for n in names if f.section(n).codec != "raw")
    return THREADS if total and 2 * packed >= total else RAW_THREADS


def read_sections(f, names: Sequence[str]) -> list | None:
    """Each section as :meth:`RVQFile.read_sections` ``(names, as_mx=True)`` returns it, in device memory,
    through the pinned ring; None where the ring is not to be had now (not CUDA, switched off, busy with
    another load in this process, the source reads in turn). Raises what reading the sections in turn would:
    the error of the first failing name."""
    if not available() or not f.concurrent_reads:
        return None
    if not _ring.lock.acquire(blocking=False):
        return None
    try:
        biggest = max((f.section(n).raw_length for n in names), default=0)
        total = sum(f.section(n).raw_length for n in names)
        threads = workers(f, names)
        # room for every worker's section and the copies behind them
        want = min(max_bytes(), max(MIN_RING, -(-min(total, (threads + 2) * (biggest + ALIGN)) // (1 << 20)) << 20))
        try:
            buffer = _ring.ensure(want)
            ok = _checked_copy(buffer)
        except pinned_memory.PinnedMemoryError as e:
            ok = False
            log.warning("pinned uploads switched off: %s", e)
        if not ok:
            with _state_lock:
                _disabled["process"] = "no pinned memory or upload kernel"
            return None
        return upload(f, names, buffer.array, lambda off, n: _launch(buffer.device_address + off, n), threads)
    finally:
        _ring.lock.release()


def upload(f, names: Sequence[str], staging: np.ndarray, launch: Callable[[int, int], mx.array],
           threads: int | None = None) -> list:
    """The pipeline: ``staging`` (a uint8 buffer) as the ring, ``launch(offset, n)`` the copy of its bytes
    ``[offset, offset + n)`` into a new array (asynchronous; its evaluation is the sign the range may be
    reused); ``threads`` workers (default :data:`THREADS`). Sections in ``names`` order, each viewed as its dtype
    and shape (bfloat16 as :meth:`RVQFile.typed` gives it); ineligible ones read the regular way, in order.
    Neighbouring sections of the ring go in one launch (:data:`GROUP_SHARE`), each section a view of its output.
    Everything it launched is complete when it returns or raises, so ``staging`` may be reused at once."""
    threads = max(1, THREADS if threads is None else threads)
    ahead = AHEAD_PER_THREAD * threads
    ring = StagingRing(staging.nbytes)
    half = ring.capacity // 2
    group_max = max(ALIGN, ring.capacity // GROUP_SHARE)
    jobs: deque = deque()  # (index, offset, future) of eligible sections submitted, in order
    group: list = []  # (index, offset, length) of sections in the ring, neighbours, not launched yet
    inflight: deque = deque()  # (output, ring ranges it read) of launches not waited for, oldest first
    out: list = [None] * len(names)
    copy = device_memory.onto_device() or (lambda a: a)

    def launch_group():
        start, (_, last, n_last) = group[0][1], group[-1]
        raw = launch(start, last + n_last - start)
        views = []
        for i, off, n in group:
            s = f.section(names[i])
            views.append(raw[off - start:off - start + n].view(_MX[s.numpy_dtype]).reshape(s.shape))
            out[i] = f.typed(names[i], views[-1])
        mx.async_eval(raw, *views)
        inflight.append((raw, len(group)))
        group.clear()

    def wait_oldest():
        raw, ranges = inflight.popleft()
        mx.eval(raw)
        for _ in range(ranges):
            ring.release()

    pool = ThreadPoolExecutor(threads, thread_name_prefix="rvq-upload")
    nxt = 0  # next name to consider for submission
    try:
        for i, name in enumerate(names):
            # keep the workers fed: submit ahead while the ring has room (ineligible names are read in turn)
            while nxt < len(names) and len(jobs) < ahead:
                if not _eligible(f, names[nxt], half):
                    nxt += 1
                    continue
                n = f.section(names[nxt]).raw_length
                off = ring.take(n)
                if off is None:
                    if inflight:
                        wait_oldest()
                    elif group:
                        launch_group()
                    else:
                        break  # the ring holds submitted jobs only: launch the next of them first
                    continue
                jobs.append((nxt, off, pool.submit(f.read_section_into, names[nxt], staging[off:off + n])))
                nxt += 1
            if jobs and jobs[0][0] == i:
                _, off, fut = jobs.popleft()
                fut.result()
                n = f.section(name).raw_length
                if group:
                    _, last, n_last = group[-1]
                    if off != last + _slot(n_last) or off + n - group[0][1] > group_max:
                        launch_group()
                group.append((i, off, n))
            else:
                out[i] = copy(f.read_section_mx(name))
        if group:
            launch_group()
        return out
    finally:
        for _, _, fut in jobs:
            fut.cancel()
        pool.shutdown(wait=True)  # no worker writes the ring after this returns
        while inflight:
            wait_oldest()
