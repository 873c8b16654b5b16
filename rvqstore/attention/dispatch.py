"""Which formulation serves one attention call on a packed cache.

- the GPU kernel (:mod:`rvqstore.attention.kernel`) for decode-shaped calls on a GPU backend;
- on MLX's CPU backend, the same formulation computed on the host (:mod:`rvqstore.attention.host`), for calls
  of any number of queries up to :data:`MAX_QUERY_BLOCKS_ON_CPU` blocks of them (prefill chunks too: it beat
  decode-then-SDPA from 1 to 2,048 queries per call, tools/results/prefill-cpu*.json);
- the MLX-ops formulation (:mod:`rvqstore.attention.ops`) up to :data:`MAX_QUERIES_ON_CODES` queries, on
  CUDA only for caches of :data:`MIN_TOKENS_FOR_OPS_CUDA` tokens or more;
- otherwise None: the caller runs decode-then-SDPA on the keys/values ``update_and_fetch`` returned;
  on CUDA also for caches shorter than :data:`MIN_TOKENS_ON_CODES_CUDA` (0: never, as measured).

The crossovers are measured by ``tools/bench_prefill.py`` (queries per call, ``tools/results/prefill-*.json``)
and ``tools/bench_generation.py`` arms ``packed-*@sdpa`` (whole decode steps): see docs/attention.md.
"""

from __future__ import annotations

import os

import mlx.core as mx

from .. import fused
from . import host, kernel, masks, ops
from .view import CodesView

#: queries per call up to which the MLX-ops formulation serves; above it, decode-then-SDPA (its scores take
#: (B, Hq, L, T) float32 at once). On the H200 it beat decode-then-SDPA at 32k tokens up to 16 queries
#: (0.62-1.01x) and lost from 32 on (1.2-4.2x; tools/results/prefill-h200*.json). Not measured on Metal
MAX_QUERIES_ON_CODES = 16
#: on the CPU, calls the host formulation would run in more blocks of queries than this (each block gathers every
#: code row again) go to decode-then-SDPA. Measured (tools/results/prefill-cpu*.json): up to 19 blocks the host won
#: every call (0.15-0.86x of decode-then-SDPA's time: SmolLM2 and 8B geometries, 1 to 2,048 queries, 512 to 16,384
#: tokens); at 64 blocks (8B geometry, 16k tokens, 512 queries) the two were level (1.02x)
MAX_QUERY_BLOCKS_ON_CPU = 32
#: on CUDA the MLX-ops formulation (calls the kernels do not take) is slower than decoding the cache and
#: running cuDNN's SDPA on short caches: 1.6-4.4x at 1k tokens, 1.2-4.6x at 8k, faster only at 32k (8B
#: geometry, 2+2 and 4+2, two runs; tools/results/prefill-h200*.json). Below this many tokens, decode-then-SDPA
MIN_TOKENS_FOR_OPS_CUDA = 32768


def _tokens_setting() -> int:
    try:
        return max(0, int(os.environ.get("RVQSTORE_MIN_TOKENS_ON_CODES", "0")))
    except ValueError:
        return 0


#: on CUDA, caches holding fewer tokens than this decline attention on the codes: the model's call then runs
#: mlx-lm's SDPA (cuDNN) on the decode that ``update_and_fetch`` handed out, as the bypass does. A short cache's
#: decode is small, and the attention kernels' fixed cost per launch is not (docs/attention.md, "A decode step
#: as the device sees it"). 0 (the default, ``RVQSTORE_MIN_TOKENS_ON_CODES``): every cache attends on its codes;
#: measured on the H200 (tools/results/generation-h200-crossover.md, 1k-32k tokens, 2+2 and 4+2): decode-then-SDPA
#: made every step slower (1.02-1.08x at 1k, 1.04-3.15x from 2k on), so the codes serve at every length.
MIN_TOKENS_ON_CODES_CUDA = _tokens_setting()


def decode_first(n_tokens: int) -> bool:
    """Whether a cache of ``n_tokens`` should leave this call to decode-then-SDPA (short caches on CUDA)."""
    return (n_tokens < MIN_TOKENS_ON_CODES_CUDA and fused.gpu_backend() == "cuda" and fused._on_gpu())


def attend(view: CodesView, queries: mx.array, scale: float, mask=None, sinks=None, *,
           use_kernels: bool = True) -> mx.array | None:
    if mask is not None:
        masks.check(mask)
    n_tokens, n_queries = view.n_coded + view.n_dense, queries.shape[2]
    if n_tokens == 0:
        return None
    if use_kernels and view.n_coded and n_queries <= MAX_QUERIES_ON_CODES:
        out = kernel.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    if host.on_cpu() and host.query_blocks(queries.shape[0], queries.shape[1], view.n_total, n_queries) \
            <= MAX_QUERY_BLOCKS_ON_CPU:
        out = host.attend(view, queries, scale, mask, sinks)
        if out is not None:
            return out
    if n_queries > MAX_QUERIES_ON_CODES:
        return None
    if n_tokens < MIN_TOKENS_FOR_OPS_CUDA and fused.gpu_backend() == "cuda" and fused._on_gpu():
        return None  # a short cache on CUDA: decoding it and cuDNN's SDPA beat the MLX-ops formulation
    return ops.attend(view, queries, scale, mask, sinks)
