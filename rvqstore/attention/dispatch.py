"""Which formulation serves one attention call on a packed cache.

- the GPU kernel (:mod:`rvqstore.attention.kernel`) for decode-shaped calls on a GPU backend;
- on MLX's CPU backend, the same formulation computed on the host (:mod:`rvqstore.attention.host`);
- the MLX-ops formulation (:mod:`rvqstore.attention.ops`) up to :data:`MAX_QUERIES_ON_CODES` queries;
- otherwise None: the caller runs decode-then-SDPA on the keys/values ``update_and_fetch`` returned;
  on CUDA also for caches shorter than :data:`MIN_TOKENS_ON_CODES_CUDA` (off until measured).

The crossover is measured (tools/bench_generation.py --crossover, results in
tools/results/generation-crossover-cpu.json): see docs/attention.md.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .. import fused
from . import host, kernel, masks, ops
from .view import CodesView

#: queries per call up to which attention runs on the codes; above it, decode-then-SDPA. Measured on
#: the CPU (SmolLM2 geometry, 4+2, 512 and 2,048 cached tokens): codes 1.7-2.0x faster at 1 query,
#: 1.2-2.7x at 4, 0.97-1.24x at 16, 0.87-1.04x from 64 queries on (docs/attention.md)
MAX_QUERIES_ON_CODES = 16


def _tokens_setting() -> int:
    try:
        return max(0, int(os.environ.get("RVQSTORE_MIN_TOKENS_ON_CODES", "0")))
    except ValueError:
        return 0


#: on CUDA, caches holding fewer tokens than this decline attention on the codes: the model's call then runs
#: mlx-lm's SDPA (cuDNN) on the decode that ``update_and_fetch`` handed out, as the bypass does. A short cache's
#: decode is small, and the attention kernels' fixed cost per launch is not (docs/attention.md, "A decode step
#: as the device sees it"). 0 (the default, ``RVQSTORE_MIN_TOKENS_ON_CODES``): every cache attends on its codes;
#: the crossover is to be measured (variants ``sdpaNk`` in tools/kernel_variants.py) before a default is chosen.
MIN_TOKENS_ON_CODES_CUDA = _tokens_setting()


def decode_first(n_tokens: int) -> bool:
    """Whether a cache of ``n_tokens`` should leave this call to decode-then-SDPA (short caches on CUDA)."""
    return (n_tokens < MIN_TOKENS_ON_CODES_CUDA and fused.gpu_backend() == "cuda" and fused._on_gpu())


def attend(view: CodesView, queries: mx.array, scale: float, mask=None, sinks=None, *,
           use_kernels: bool = True) -> mx.array | None:
    if mask is not None:
        masks.check(mask)
    if view.n_coded + view.n_dense == 0 or queries.shape[2] > MAX_QUERIES_ON_CODES:
        return None
    if use_kernels and view.n_coded:
        out = kernel.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    if host.on_cpu():
        out = host.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    return ops.attend(view, queries, scale, mask, sinks)
