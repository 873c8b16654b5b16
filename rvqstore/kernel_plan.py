"""Launch plans for the fused RVQ kernels: which layout, search, chunk and table a codec's kernel uses.

Pure planning (no launches, no backend): :func:`make_plan` turns a codec's settings into a
:class:`Plan` or a string saying why the kernels don't take it. :mod:`rvqstore.fused` launches the
plans; :mod:`rvqstore.kernel_checks` checks the kernels against the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

ENCODE, DECODE = "encode", "decode"
DIALECTS = ("metal", "cuda")
MODE_SINGLE, MODE_CONDITIONAL, MODE_SHARED = 0, 1, 2
SEARCH_BINARY, SEARCH_LINEAR = 0, 1
LAYOUT_CHUNK, LAYOUT_LANES = 0, 1

#: count the thresholds linearly up to this many, binary-search above (see tools/results/kernels-notes.md)
LINEAR_MAX_THRESHOLDS = 3


# ---- plans: everything a launch needs, per codec -------------------------------------------------
@dataclass(frozen=True)
class Plan:
    kind: str
    dim: int
    bits1: int
    bits2: int  # 0: single stage (decode: also stage 1 only)
    mode: int
    chunk: int  # coordinates holding whole words of both streams (= per thread in the chunk layout)
    vl: int  # vector width of the float loads/stores (chunk layout)
    search: int
    layout: int  # the default layout (see make_plan)
    lanes_ok: bool  # the lanes layout can run this configuration (1/2/4-bit codes, dim % 4 == 0)
    tab: mx.array
    tabn: int
    words1: int
    words2: int

    @property
    def chunks_per_vector(self) -> int:
        return -(-self.dim // self.chunk)

    def threads_per_vector(self, layout: int | None = None) -> int:
        layout = self.layout if layout is None else layout
        if layout == LAYOUT_CHUNK:
            return self.chunks_per_vector
        if self.kind == ENCODE:  # whole chunks, so the lanes of a word never straddle two vectors
            return self.chunks_per_vector * (self.chunk // 4)
        return self.dim // 4

    def template(self, search: int | None = None, layout: int | None = None) -> list[tuple[str, int]]:
        t = [("T_B1", self.bits1), ("T_B2", self.bits2), ("T_MODE", self.mode)]
        if self.kind == ENCODE:
            t.append(("T_SEARCH", self.search if search is None else search))
        t.append(("T_LAYOUT", self.layout if layout is None else layout))
        return t + [("T_VL", self.vl), ("T_C", self.chunk), ("T_TABN", self.tabn)]


def config_key(codec, kind: str, stage1_only: bool = False) -> tuple:
    """What a latch applies to: one kernel configuration."""
    b2 = 0 if (stage1_only or not codec.bits2) else codec.bits2
    return (kind, codec.dim, codec.bits1, b2, codec.residual if b2 else "none")


def _chunk(b1: int, b2: int) -> int:
    p1 = 32 // b1
    return p1 if not b2 else math.lcm(p1, 32 // b2)


def _vector_width(dim: int, chunk: int) -> int:
    for vl in (4, 2, 1):
        if dim % vl == 0 and chunk % vl == 0:
            return vl
    return 1


def _table(values: list[np.ndarray]) -> tuple[mx.array, int]:
    t = np.concatenate([np.asarray(v, dtype=np.float32).ravel() for v in values])
    n = int(t.size)
    # at least 8 entries: Metal passes smaller inputs in the constant address space
    pad = np.zeros(max(8, n), dtype=np.float32)
    pad[:n] = t
    return mx.array(pad), max(n, 1)


def _sorted(v: np.ndarray) -> bool:
    v = np.asarray(v, dtype=np.float32).ravel()
    return bool(np.all(np.isfinite(v))) and bool(np.all(v[1:] >= v[:-1]))


def make_plan(codec, kind: str, stage1_only: bool = False) -> Plan | str:
    """The launch plan for ``codec``, or a string saying why the kernels don't take it."""
    b1 = codec.bits1
    b2 = 0 if (stage1_only or not codec.bits2) else codec.bits2
    if not (1 <= b1 <= 4 and 0 <= b2 <= 4):
        return f"bits {(b1, b2)} out of range"
    c1 = np.asarray(codec.centroids1, np.float32)
    bd1 = np.asarray(codec.boundaries1, np.float32)
    if c1.shape != (1 << b1,) or bd1.shape != ((1 << b1) - 1,) or not _sorted(bd1):
        return "stage-1 tables malformed"
    if b2:
        c2 = np.asarray(codec.centroids2, np.float32)
        bd2 = np.asarray(codec.boundaries2, np.float32)
        if c2.shape != (1 << b1, 1 << b2) or bd2.shape != (1 << b1, (1 << b2) - 1):
            return "stage-2 tables malformed"
    mode = MODE_SINGLE
    if b2:
        mode = MODE_CONDITIONAL if codec.residual == "conditional" else MODE_SHARED
    if kind == ENCODE:
        if mode == MODE_SINGLE:
            parts = [bd1]
        elif mode == MODE_CONDITIONAL:
            fine = getattr(codec, "_fine_thresholds", None)
            if fine is None or len(fine) != (1 << (b1 + b2)) - 1 or not _sorted(fine):
                return "conditional thresholds not nested"
            parts = [fine]
        else:
            if not _sorted(bd2[0]):
                return "shared stage-2 boundaries unsorted"
            parts = [bd1, c1, bd2[0]]
        nthr = (1 << (b1 + b2)) - 1 if mode == MODE_CONDITIONAL else (1 << max(b1, b2)) - 1
        search = SEARCH_LINEAR if nthr <= LINEAR_MAX_THRESHOLDS else SEARCH_BINARY
    elif kind == DECODE:
        parts = [c1] if mode == MODE_SINGLE else [c2.ravel()] if mode == MODE_CONDITIONAL else [c1, c2[0]]
        search = SEARCH_BINARY
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    tab, tabn = _table(parts)
    chunk = _chunk(b1, b2)
    lanes = codec.dim % 4 == 0 and b1 in (1, 2, 4) and b2 in (0, 1, 2, 4)
    # measured on the H200 (tools/results/kernels-notes.md): encode is fastest with a thread per chunk
    # (whole words, 16-byte loads), decode with a thread per float4 (fully coalesced 16-byte stores)
    layout = LAYOUT_LANES if (lanes and kind == DECODE) else LAYOUT_CHUNK
    return Plan(kind, codec.dim, b1, b2, mode, chunk, _vector_width(codec.dim, chunk), search,
                layout, lanes, tab, tabn, codec.words1, codec.words2 if b2 else 0)
